"""How long each SGLang scheduler waited for a CPU while it had work: the kernel's own count, sampled under load.

At 64 streams SGLang's scheduler runs at 100% of a core, so its step rate is what caps the token rate. Run at the
same time on the same machine (`bench_aiperf.py --together`), the scheduler inside Conveyor's decode worker stepped
~0.9x as fast as the server's (docs/performance.md, twenty-seventh stop) with the same code, settings and requests.
One reading: the stack's other busy processes (gateways, processor, nats-server, the decode worker's loop) wake
thousands of times a second and land on the scheduler's CPU. Linux counts the time a runnable task spent waiting in
a run queue (/proc/PID/schedstat, second field) and the times it was switched out against its will
(nonvoluntary_ctxt_switches); this reads both for each scheduler's main thread, so the reading can be tested
instead of argued.

    python3 scripts/sched_wait.py --out /tmp/sched.log &                 # sample every 2 s until stopped
    python3 scripts/sched_wait.py --summary /tmp/sched.log               # per scheduler, its loaded intervals
    python3 scripts/sched_wait.py --list                                 # NAME=PID of each, e.g. for py-spy:
    python3 scripts/profile_processes.py $(python3 scripts/sched_wait.py --list) --when-busy server --duration-s 15

Each scheduler is named by the first --label whose pattern appears in its own or an ancestor's command line, nearest
ancestor first (defaults: gpu_hold.sh's server and stacks a, b and c); others by their pid. `scripts/gpu_goals.sh` runs
it beside every run and writes the summary to sched-wait.txt. Linux only.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engines.cpu_pinning import SCHEDULER_TITLE, parent_pid, user_processes  # noqa: E402

PROC = Path("/proc")
# The second server (gpu_hold.sh server2) is told apart by its port, so its pattern goes first.
DEFAULT_LABELS = ["server2=--port 30001", "server=sglang.launch_server", "b=--out /tmp/b", "c=--out /tmp/c",
                  "conveyor=--out /tmp/a"]


@dataclass(frozen=True)
class Sample:
    cpu_s: float  # CPU time of the main thread so far
    wait_s: float  # time runnable but waiting for a CPU so far
    involuntary_switches: int
    cpu: int  # the CPU it last ran on


def read_sample(pid: int) -> Sample | None:
    """The main thread's counters now; None when the process is gone."""
    try:
        ran_ns, waited_ns, _ = (PROC / str(pid) / "schedstat").read_text().split()
        stat = (PROC / str(pid) / "stat").read_text()
        status = (PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    # The command name in stat may hold spaces: fields after its closing parenthesis are fixed.
    fields = stat[stat.rindex(")") + 2:].split()
    switches = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("nonvoluntary_ctxt_switches"))
    return Sample(cpu_s=int(ran_ns) / 1e9, wait_s=int(waited_ns) / 1e9, involuntary_switches=switches,
                  cpu=int(fields[36]))


def label_for(pid: int, labels: list[tuple[str, str]], commands: dict[int, str]) -> str:
    """The first label whose pattern is in this process's or an ancestor's command line (`commands`: pid → command
    line, as user_processes reads them), nearest first."""
    current = pid
    while current > 1:
        line = commands.get(current, "")
        for name, pattern in labels:
            if pattern in line:
                return name
        current = parent_pid(current)
    return f"pid{pid}"


def schedulers(title: str) -> tuple[list[int], dict[int, str]]:
    """The pids whose command line starts with `title`, and every process's command line (for their labels)."""
    commands = user_processes()
    return sorted(pid for pid, line in commands.items() if line.startswith(title)), commands


def sample(out: Path, title: str, labels: list[tuple[str, str]], interval_s: float,
           max_samples: int | None = None) -> None:
    """Every interval (max_samples times, or until stopped), one line per scheduler: time, label, pid, CPU %, wait %,
    involuntary switches/s, the CPU it last ran on. A process's first sample writes nothing: rates need two."""
    last: dict[int, tuple[float, Sample]] = {}
    names: dict[int, str] = {}
    with out.open("a", buffering=1) as log:
        for _ in itertools.count() if max_samples is None else range(max_samples):
            pids, commands = schedulers(title)
            for pid in pids:
                now, now_s = read_sample(pid), time.monotonic()
                if now is None:
                    continue
                if pid not in names:
                    names[pid] = label_for(pid, labels, commands)
                if pid in last:
                    then_s, before = last[pid]
                    span_s = now_s - then_s
                    log.write(f"{time.strftime('%H:%M:%S')} {names[pid]} {pid} "
                              f"{100 * (now.cpu_s - before.cpu_s) / span_s:.1f} "
                              f"{100 * (now.wait_s - before.wait_s) / span_s:.1f} "
                              f"{(now.involuntary_switches - before.involuntary_switches) / span_s:.0f} "
                              f"{now.cpu}\n")
                last[pid] = (now_s, now)
            time.sleep(interval_s)


@dataclass(frozen=True)
class Waiting:
    label: str
    intervals: int
    cpu_percent: float
    wait_percent: float  # of wall time, while loaded
    switches_per_s: float
    cpus_seen: int  # how many different CPUs it was found on


def summarize(lines: list[str], min_cpu_percent: float) -> list[Waiting]:
    """Per label, over its loaded intervals (CPU at least min_cpu_percent): medians, and the CPUs it moved over."""
    by_label: dict[str, list[tuple[float, float, float, int]]] = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 7:
            continue
        cpu_percent, wait_percent, switches = float(parts[3]), float(parts[4]), float(parts[5])
        if cpu_percent >= min_cpu_percent:
            by_label.setdefault(parts[1], []).append((cpu_percent, wait_percent, switches, int(parts[6])))
    return [Waiting(label=label, intervals=len(rows), cpu_percent=statistics.median(r[0] for r in rows),
                    wait_percent=statistics.median(r[1] for r in rows),
                    switches_per_s=statistics.median(r[2] for r in rows), cpus_seen=len({r[3] for r in rows}))
            for label, rows in by_label.items()]


def print_summary(rows: list[Waiting]) -> None:
    print(f"{'scheduler':<12} {'intervals':>9} {'CPU %':>6} {'waiting for a CPU %':>20} {'switched out /s':>16} "
          f"{'CPUs':>5}")
    for row in rows:
        print(f"{row.label:<12} {row.intervals:>9} {row.cpu_percent:>6.1f} {row.wait_percent:>20.1f} "
              f"{row.switches_per_s:>16.0f} {row.cpus_seen:>5}")


def parse_label(text: str) -> tuple[str, str]:
    name, separator, pattern = text.partition("=")
    if not separator or not name or not pattern:
        raise argparse.ArgumentTypeError(f"a label is NAME=PATTERN, not {text!r}")
    return name, pattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="sample until stopped, appending to this file")
    parser.add_argument("--summary", type=Path, help="summarize a file written with --out")
    parser.add_argument("--list", action="store_true", help="print NAME=PID of each scheduler running now")
    parser.add_argument("--title", default=SCHEDULER_TITLE,
                        help="the start of the sampled processes' command lines (SGLang sets its schedulers')")
    parser.add_argument("--label", type=parse_label, action="append",
                        help=f"NAME=PATTERN, repeatable (default: {' '.join(DEFAULT_LABELS)})")
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--min-cpu-percent", type=float, default=60.0,
                        help="intervals with less CPU than this are idle or warm-up, and left out of the summary")
    args = parser.parse_args()
    labels = args.label or [parse_label(text) for text in DEFAULT_LABELS]
    if args.summary:
        print_summary(summarize(args.summary.read_text().splitlines(), args.min_cpu_percent))
    elif args.list:
        pids, commands = schedulers(args.title)
        print(" ".join(f"{label_for(pid, labels, commands)}={pid}" for pid in pids))
    elif args.out:
        try:
            sample(args.out, args.title, labels, args.interval_s)
        except KeyboardInterrupt:
            pass
    else:
        parser.error("--out, --summary or --list")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
