"""Each CPU's time between two /proc/stat snapshots: busy, idle, and stolen by the hypervisor.

On a virtual machine a CPU's "steal" is time it wanted to run and the host ran something else; the kernel inside
cannot see it as waiting (scripts/sched_wait.py reads 0% there). The decode worker holds its SGLang scheduler on the
two highest-numbered CPUs; at one stream, where a step is 1.8 ms of mostly CPU work, the stack's engine stepped 0.83x
the server's on one H100 machine and 0.93-1.01x on another (docs/performance.md, thirty-first stop). If the held CPUs
lose time to the host, this shows it; `scripts/gpu_goals.sh` snapshots /proc/stat at a run's start and end and writes
this table to cpu-steal.txt.

    cat /proc/stat > /tmp/stat-start; ...; python3 scripts/cpu_steal.py /tmp/stat-start /proc/stat
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

# /proc/stat's cpu lines: user nice system idle iowait irq softirq steal guest guest_nice (ticks since boot).
IDLE_FIELDS = (3, 4)  # idle, iowait
STEAL_FIELD = 7
GUEST_FIELDS = (8, 9)  # already counted in user and nice


@dataclass(frozen=True)
class CpuTime:
    name: str  # "cpu" (all of them) or "cpu14"
    busy_ticks: int
    idle_ticks: int
    steal_ticks: int

    @property
    def total_ticks(self) -> int:
        return self.busy_ticks + self.idle_ticks + self.steal_ticks


def read_stat(text: str) -> dict[str, CpuTime]:
    times = {}
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu"):
            continue
        ticks = [int(value) for value in fields]
        counted = [value for index, value in enumerate(ticks) if index not in GUEST_FIELDS]
        idle = sum(ticks[index] for index in IDLE_FIELDS if index < len(ticks))
        steal = ticks[STEAL_FIELD] if len(ticks) > STEAL_FIELD else 0
        times[name] = CpuTime(name, busy_ticks=sum(counted) - idle - steal, idle_ticks=idle, steal_ticks=steal)
    return times


def between(start: dict[str, CpuTime], end: dict[str, CpuTime]) -> list[CpuTime]:
    """Each CPU's ticks from start to end, the all-CPU line first, then by CPU number."""
    def order(name: str) -> int:
        return -1 if name == "cpu" else int(name[3:])

    return [CpuTime(name, end[name].busy_ticks - start[name].busy_ticks, end[name].idle_ticks - start[name].idle_ticks,
                    end[name].steal_ticks - start[name].steal_ticks)
            for name in sorted(set(start) & set(end), key=order)]


def percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("start", type=Path, help="a copy of /proc/stat taken at the start")
    parser.add_argument("end", type=Path, help="one taken at the end (/proc/stat itself: now)")
    args = parser.parse_args()
    rows = between(read_stat(args.start.read_text()), read_stat(args.end.read_text()))
    print(f"{'cpu':<6} {'busy %':>7} {'steal %':>8} {'idle %':>7}")
    for row in rows:
        total = row.total_ticks
        print(f"{'all' if row.name == 'cpu' else row.name[3:]:<6} {percent(row.busy_ticks, total):>7.1f} "
              f"{percent(row.steal_ticks, total):>8.2f} {percent(row.idle_ticks, total):>7.1f}")


if __name__ == "__main__":
    main()
