"""How fast one single-threaded Python process runs while other cores are busy: does a busier machine slow it?

SGLang's scheduler is one Python thread at 100% of a core, and with a small model its Python caps the token rate. At
64 streams the scheduler inside Conveyor's decode worker steps 0.77-0.91x as fast as the server's at about equal
batch sizes, with the same profile (docs/performance.md, twenty-second and twenty-sixth stops), and Conveyor's stack
keeps about two more cores busy than the server does (decode worker, gateways, nats-server, processor). Pinning each
scheduler to whole cores of its own did not close the gap (twenty-third stop), which leaves what a core shares with
every other: its clock (turbo falls as more cores are active), the last-level cache and memory bandwidth.

This measures that directly. One process, pinned to a CPU whose hyperthread siblings stay idle, runs a fixed
scheduler-like Python workload (small objects, dict and list work, pickling a batch) and counts rounds a second,
while K helper processes, pinned to other physical cores, either spin (`spin`: the clock) or copy buffers larger than
the cache (`memory`: the cache and memory bandwidth). Levels run in a forward then reversed order each round, so a
drift over the run does not read as an effect.

    .venv/bin/python scripts/bench_cpu_neighbours.py --busy 0 1 --rounds 2          # this machine
    bash scripts/gpu_run.sh python3 scripts/bench_cpu_neighbours.py                 # the GPU machine (16 CPUs)

Prints, per kind and number of busy cores, the median rate and its ratio to the idle machine's, with the measured
CPU's clock where /sys or /proc/cpuinfo tell it. Linux only (CPU affinity).

`--survey` instead times the same workload on each CPU in turn, the rest of the machine as it is (idle at a lease's
start): is a CPU slower than the others? The decode worker holds its SGLang scheduler on the highest-numbered whole
cores (workers/engines/cpu_pinning.py), so a slow CPU there would slow only the stack's engine; on an H100 machine
with a GPU each, the stack's SGLang stepped 0.94x the server's at one running request (docs/performance.md,
forty-first stop). Those CPUs are marked in the table.

    bash scripts/gpu_run.sh python3 scripts/bench_cpu_neighbours.py --survey

`--siblings CPU...` times the workload on each named CPU while one spinning helper moves over every other CPU in turn:
a CPU that slows it well beyond the rest shares its physical core. A VM may show one thread per core while the host
runs two vCPUs on one core's two threads (the forty-third stop's H100 machines: 64 vCPUs, "1 thread per core"); a
scheduler held on such a vCPU runs as fast as whatever its hidden sibling runs lets it.

    bash scripts/gpu_run.sh python3 scripts/bench_cpu_neighbours.py --siblings 62 14 --rounds 2 --window-s 0.25
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from isolate_schedulers import physical_cores  # noqa: E402  — the machine's cores, hyperthread siblings together

from workers.engines.cpu_pinning import CPUS_PER_SCHEDULER, claim_cores  # noqa: E402  (isolate_schedulers set the path)

SETTLE_S = 0.3  # helpers reach full speed (and the clock its new level) before the window opens
MEMORY_BUFFER_BYTES = 256 * 1024 * 1024  # far beyond any last-level cache here


@dataclass(frozen=True)
class Reading:
    kind: str
    busy_cores: int
    rounds_per_s: float
    clock_mhz: float | None


def clock_mhz(cpu: int) -> float | None:
    """The CPU's current clock: cpufreq if the kernel exposes it, else /proc/cpuinfo's 'cpu MHz' for that CPU."""
    freq = Path(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
    if freq.exists():
        return int(freq.read_text()) / 1000
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
    except OSError:
        return None
    for block in blocks:
        fields = {name.strip(): value.strip() for name, _, value in (line.partition(":") for line in block.splitlines())}
        if fields.get("processor") == str(cpu) and "cpu MHz" in fields:
            return float(fields["cpu MHz"])
    return None


def scheduler_like_round(batch_size: int = 64) -> int:
    """One round of work shaped like a scheduler step's Python: per request objects, lookups, a pickled output."""
    requests = [{"rid": f"req-{i}", "output_ids": list(range(i % 7 + 1)), "finished": False} for i in range(batch_size)]
    by_rid = {request["rid"]: request for request in requests}
    for step_token, request in enumerate(requests):
        by_rid[request["rid"]]["output_ids"].append(step_token)
        request["finished"] = len(request["output_ids"]) > 6
    return len(pickle.dumps([(r["rid"], r["output_ids"][-1], r["finished"]) for r in requests]))


def rounds_per_s(cpu: int, window_s: float) -> float:
    os.sched_setaffinity(0, {cpu})
    rounds = 0
    deadline = time.perf_counter() + window_s
    while time.perf_counter() < deadline:
        for _ in range(50):
            scheduler_like_round()
        rounds += 50
    return rounds / window_s


def busy(kind: str, cpu: int, stop: mp.Event) -> None:
    os.sched_setaffinity(0, {cpu})
    if kind == "spin":
        while not stop.is_set():
            for _ in range(100_000):
                pass
        return
    source, target = bytearray(MEMORY_BUFFER_BYTES), bytearray(MEMORY_BUFFER_BYTES)
    while not stop.is_set():
        target[:] = source


def reading_with_neighbours(kind: str, busy_cpus: list[int], measured_cpu: int, window_s: float) -> Reading:
    context = mp.get_context("spawn")
    stop = context.Event()
    helpers = [context.Process(target=busy, args=(kind, cpu, stop), daemon=True) for cpu in busy_cpus]
    for helper in helpers:
        helper.start()
    time.sleep(SETTLE_S + (0.5 if helpers and kind == "memory" else 0.0))  # the memory helpers allocate first
    rate = rounds_per_s(measured_cpu, window_s)
    clock = clock_mhz(measured_cpu)
    stop.set()
    for helper in helpers:
        helper.join(timeout=5)
        if helper.is_alive():
            helper.kill()
    return Reading(kind, len(busy_cpus), rate, clock)


def plan(cores: list[list[int]], wanted: list[int]) -> tuple[int, list[int], list[int]]:
    """The measured CPU (the last core's first thread; its siblings left idle), the CPUs helpers may take (one per
    other physical core first, then the other cores' siblings) and the busy levels that fit."""
    measured_core, *others = cores[::-1]
    helper_cpus = [core[0] for core in others] + [cpu for core in others for cpu in core[1:]]
    return measured_core[0], helper_cpus, [level for level in wanted if level <= len(helper_cpus)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2, 4, 6, 8, 12],
                        help="numbers of busy helper cores to measure beside the idle machine (default: %(default)s)")
    parser.add_argument("--kinds", nargs="+", choices=["spin", "memory"], default=["spin", "memory"])
    parser.add_argument("--rounds", type=int, default=3, help="forward-then-reverse passes over the levels")
    parser.add_argument("--window-s", type=float, default=1.5, help="seconds each reading counts")
    parser.add_argument("--survey", action="store_true",
                        help="time the workload on each CPU in turn instead (--rounds passes, --window-s each; "
                             "try --window-s 0.3)")
    parser.add_argument("--siblings", type=int, nargs="+", metavar="CPU", default=None,
                        help="find which CPUs share a physical core with each of these (--rounds passes, --window-s "
                             "each; try --window-s 0.25)")
    args = parser.parse_args()
    if args.survey:
        survey(args.rounds, args.window_s)
        return
    if args.siblings:
        for cpu in args.siblings:
            find_siblings(cpu, args.rounds, args.window_s)
        return

    allowed = os.sched_getaffinity(0)
    cores = [[cpu for cpu in core if cpu in allowed] for core in physical_cores()]
    cores = [core for core in cores if core]
    measured_cpu, helper_cpus, levels = plan(cores, sorted(set([0, *args.busy])))
    print(f"[cpu-neighbours] {len(cores)} physical cores, {os.cpu_count()} CPUs; measuring on CPU {measured_cpu}, "
          f"helpers on {helper_cpus}; levels {levels}", flush=True)
    readings: list[Reading] = []
    for round_index in range(args.rounds):
        order = levels if round_index % 2 == 0 else levels[::-1]
        for kind in args.kinds:
            for level in order:
                reading = reading_with_neighbours(kind, helper_cpus[:level], measured_cpu, args.window_s)
                readings.append(reading)
                clock = f", {reading.clock_mhz:.0f} MHz" if reading.clock_mhz else ""
                print(f"[cpu-neighbours] round {round_index + 1}: {kind} x{level}: "
                      f"{reading.rounds_per_s:,.0f} rounds/s{clock}", flush=True)
    report(readings, args.kinds, levels)


def survey(rounds: int, window_s: float) -> None:
    """Each allowed CPU's rate for the workload, median over `rounds` passes (forward, then reversed, so a drift over
    the run does not read as a CPU's), and its ratio to the median CPU's."""
    cpus = sorted(os.sched_getaffinity(0))
    held = cpus_a_scheduler_would_hold(cpus)
    print(f"[cpu-survey] {len(cpus)} CPUs, {rounds} passes of {window_s} s each; a stack's first scheduler would be "
          f"held on {held}", flush=True)
    rates: dict[int, list[float]] = {cpu: [] for cpu in cpus}
    try:
        for round_index in range(rounds):
            for cpu in cpus if round_index % 2 == 0 else cpus[::-1]:
                rates[cpu].append(rounds_per_s(cpu, window_s))
    finally:
        os.sched_setaffinity(0, cpus)  # rounds_per_s held this process on the CPU it timed
    medians = {cpu: statistics.median(values) for cpu, values in rates.items()}
    middle = statistics.median(medians.values())
    print("\nthe scheduler-like workload on each CPU (median over passes; ratio to the median CPU's)")
    print(f"{'cpu':>4} {'rounds/s':>10} {'ratio':>7} {'spread':>7} {'clock MHz':>10}  held")
    for cpu in cpus:
        spread = (max(rates[cpu]) - min(rates[cpu])) / medians[cpu] if medians[cpu] else 0.0
        clock = clock_mhz(cpu)
        clock_text = f"{clock:>10.0f}" if clock else f"{'-':>10}"
        mark = "  *" if cpu in held else ""
        print(f"{cpu:>4} {medians[cpu]:>10,.0f} {medians[cpu] / middle:>6.2f}x {spread:>6.0%} {clock_text}{mark}")
    if held:
        held_rate = statistics.median(medians[cpu] for cpu in held)
        print(f"held CPUs {held}: {held_rate / middle:.2f}x the median CPU")


def cpus_a_scheduler_would_hold(allowed: list[int]) -> list[int]:
    """The CPUs the decode worker's first scheduler takes on this machine: cpu_pinning's own claim, made in a lock
    directory of its own (no other worker holding any) and let go at once."""
    with tempfile.TemporaryDirectory(prefix="cpu-survey-") as lock_dir:
        claim = claim_cores(CPUS_PER_SCHEDULER, Path(lock_dir), allowed=set(allowed))
        if claim is None:
            return []
        claim.release()
        return claim.cpus


PARKED = -1  # the helper's target while it should sleep: no CPU busy beside the measured one


def roaming_spinner(target, stop: mp.Event) -> None:
    """Spin on the CPU `target` names, following it as it changes; sleep while it is PARKED."""
    held = None
    while not stop.is_set():
        cpu = target.value
        if cpu == PARKED:
            time.sleep(0.005)
            continue
        if cpu != held:
            os.sched_setaffinity(0, {cpu})
            held = cpu
        for _ in range(20_000):
            pass


def find_siblings(measured_cpu: int, rounds: int, window_s: float) -> None:
    """The workload's rate on `measured_cpu` with a helper spinning on each other CPU in turn, against its rate with
    the helper asleep (read between every few others, so a drift does not read as a sibling)."""
    allowed = os.sched_getaffinity(0)
    others = [cpu for cpu in sorted(allowed) if cpu != measured_cpu]
    context = mp.get_context("spawn")
    target, stop = context.Value("i", PARKED), context.Event()
    helper = context.Process(target=roaming_spinner, args=(target, stop), daemon=True)
    helper.start()
    time.sleep(SETTLE_S)
    beside: dict[int, list[float]] = {cpu: [] for cpu in others}
    alone: list[float] = []
    print(f"[cpu-siblings] CPU {measured_cpu}: a spinner on each of {len(others)} other CPUs in turn, {rounds} "
          f"passes of {window_s} s each", flush=True)
    try:
        for round_index in range(rounds):
            for index, cpu in enumerate(others if round_index % 2 == 0 else others[::-1]):
                if index % 8 == 0:
                    target.value = PARKED
                    time.sleep(0.02)
                    alone.append(rounds_per_s(measured_cpu, window_s))
                target.value = cpu
                time.sleep(0.02)  # the helper moves and spins before the window opens
                beside[cpu].append(rounds_per_s(measured_cpu, window_s))
    finally:
        stop.set()
        helper.join(timeout=5)
        if helper.is_alive():
            helper.kill()
        os.sched_setaffinity(0, allowed)  # rounds_per_s held this process on the CPU it timed
    idle = statistics.median(alone)
    ratios = sorted((statistics.median(rates) / idle, cpu) for cpu, rates in beside.items())
    typical = statistics.median(ratio for ratio, _ in ratios)
    print(f"CPU {measured_cpu} alone: {idle:,.0f} rounds/s; with a spinner elsewhere typically {typical:.2f}x. "
          f"Slowest beside (a sibling reads well below the rest):")
    for ratio, cpu in ratios[:6]:
        print(f"  spinner on CPU {cpu:>3}: {ratio:.2f}x")


def report(readings: list[Reading], kinds: list[str], levels: list[int]) -> None:
    print("\none scheduler-like Python thread beside busy cores (median over rounds; ratio to the same kind's 0 busy)")
    print(f"{'kind':<8} {'busy cores':>10} {'rounds/s':>12} {'ratio':>7} {'clock MHz':>10}")
    for kind in kinds:
        idle = statistics.median(r.rounds_per_s for r in readings if r.kind == kind and r.busy_cores == 0)
        for level in levels:
            mine = [r for r in readings if r.kind == kind and r.busy_cores == level]
            rate = statistics.median(r.rounds_per_s for r in mine)
            clocks = [r.clock_mhz for r in mine if r.clock_mhz]
            clock = f"{statistics.median(clocks):>10.0f}" if clocks else f"{'-':>10}"
            print(f"{kind:<8} {level:>10} {rate:>12,.0f} {rate / idle:>6.2f}x {clock}")


if __name__ == "__main__":
    main()
