"""Give each SGLang scheduler process CPUs of its own, and keep every other process off them (or undo it).

On the H100 machine both SGLang schedulers (the server's and the one inside Conveyor's decode worker) sit at 100% of a
core: with a small model their Python is what caps the token rate. At 64 streams and equal batch sizes, Conveyor's
engine took 0.91x the server's decode steps a second (scripts/sglang_steps.py; docs/performance.md, twenty-second
stop), with the same profile inside the scheduler. Conveyor's stack runs about five more busy processes than the
server (decode worker, gateways, processor, nats-server), so one reading is that its scheduler shares a core's
caches or hyperthread sibling with them. This tests that reading: pin, measure, undo, measure, in one lease.

    python3 scripts/isolate_schedulers.py            # pin: each scheduler to 2 CPUs of its own (whole cores)
    python3 scripts/isolate_schedulers.py --undo     # every process back on every CPU
    python3 scripts/isolate_schedulers.py --dry-run  # print the plan only

Processes started later take their parent's CPUs: start the load client and anything else on the others with
--run, which pins first, e.g. `python3 scripts/isolate_schedulers.py --run bash scripts/gpu_goals.sh start 2` (or
`taskset -c "$(python3 scripts/isolate_schedulers.py --others)" COMMAND`).

Schedulers are found by their process title (`sglang::scheduler`). Cores are read from
/sys/devices/system/cpu/cpu*/topology/thread_siblings_list; schedulers get cores on the GPU's NUMA node first (where
nvidia-smi and sysfs tell it), the highest-numbered first, away from where the kernel places work first. The
topology it found is printed with the plan, so a run's output records it. Every thread of every other process
(kernel threads excepted) is allowed everything else. Linux only; needs the right to set other processes' affinity
(root on the GPU machine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.engines.cpu_pinning import (  # noqa: E402
    SCHEDULER_TITLE,
    claim_order,
    parse_cpu_list,
    pci_device_dir,
    physical_cores,
    pin_threads,
    user_processes,
)


def cpu_node(cpu: int) -> int:
    """The NUMA node a logical CPU belongs to (0 where the kernel shows none)."""
    nodes = list(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    return int(nodes[0].name.removeprefix("node")) if nodes else 0


def gpu_node() -> int | None:
    """The NUMA node of the first GPU's PCI device, where nvidia-smi and the kernel say (None: unknown)."""
    try:
        bus_id = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    node_file = pci_device_dir(bus_id) / "numa_node"
    node = int(node_file.read_text()) if node_file.exists() else -1
    return node if node >= 0 else None


def reservation_order(cores: list[list[int]], node: int | None) -> list[list[int]]:
    """Cores to give schedulers, best first: on the GPU's NUMA node (its launches and copies cross no socket), then
    the highest-numbered, away from where the kernel places work first."""
    on_node = None if node is None else {cpu for core in cores for cpu in core if cpu_node(cpu) == node}
    return claim_order(cores, on_node)  # the rule a worker claims its schedulers' cores by


def reserve(schedulers: list[int], cores: list[list[int]], cpus_each: int) -> dict[int, list[int]]:
    """Whole cores for each scheduler, in `cores`' order, until it has at least `cpus_each` CPUs: its main loop and
    the threads beside it (a single CPU would put them on one another's time, as trace_hops.py's --pin did)."""
    reserved: dict[int, list[int]] = {}
    free = iter(cores)
    for pid in schedulers:
        cpus: list[int] = []
        while len(cpus) < cpus_each:
            core = next(free, None)
            if core is None:
                raise ValueError(f"{len(schedulers)} schedulers of {cpus_each} CPUs each do not fit {len(cores)} cores")
            cpus.extend(core)
        reserved[pid] = sorted(cpus)
    return reserved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--undo", action="store_true", help="let every process run on every CPU again")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--others", action="store_true", help="print only the CPUs left to other processes "
                        "(a list for taskset -c), change nothing")
    parser.add_argument("--cpus-per-scheduler", type=int, default=2, help="CPUs each scheduler gets, in whole cores "
                        "(default 2: its loop and the threads beside it)")
    parser.add_argument("--run", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="then run COMMAND on the CPUs left to other processes (with --undo: on every CPU)")
    args = parser.parse_args()

    cores = physical_cores()
    every_cpu = {cpu for core in cores for cpu in core}
    processes = user_processes()
    schedulers = sorted(pid for pid, command in processes.items() if command.startswith(SCHEDULER_TITLE))
    if args.undo:
        plan = {pid: every_cpu for pid in processes}
    else:
        if not schedulers:
            sys.exit(f"no process titled {SCHEDULER_TITLE!r}: start the server or a stack first")
        node = gpu_node()
        if not args.others:
            nodes = sorted({cpu_node(cpu) for cpu in every_cpu})
            print(f"{len(every_cpu)} CPUs in {len(cores)} cores, NUMA nodes {nodes}, the GPU on node "
                  f"{'unknown' if node is None else node}")
        try:
            reserved = reserve(schedulers, reservation_order(cores, node), args.cpus_per_scheduler)
        except ValueError as error:
            sys.exit(str(error))
        others = every_cpu - {cpu for cpus in reserved.values() for cpu in cpus}
        if not others:
            sys.exit("the schedulers would take every CPU: nothing would be left for the rest")
        if args.others:
            print(",".join(str(cpu) for cpu in sorted(others)))
            return
        plan = {pid: set(reserved.get(pid, others)) for pid in processes}
        for pid, cpus in reserved.items():
            print(f"scheduler {pid}: CPUs {cpus}, kept from every other process")
        print(f"every other process: CPUs {sorted(others)}")
    if args.dry_run:
        return
    threads = sum(pin_threads(pid, sorted(cpus)) for pid, cpus in plan.items())
    print(f"{'undone' if args.undo else 'pinned'}: {threads} threads of {len(plan)} processes", flush=True)
    if args.run:
        os.sched_setaffinity(0, every_cpu if args.undo else others)
        os.execvp(args.run[0], args.run)


if __name__ == "__main__":
    main()
