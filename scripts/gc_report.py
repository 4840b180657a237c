"""How much of each process's time went to Python's garbage collector, level by level: the probe's files read back.

scripts/gc_probe/sitecustomize.py (CONVEYOR_GC_PROBE_DIR=DIR, its folder on PYTHONPATH) leaves each process's running
totals in DIR/gc-PID.jsonl. This prints, per process, the share of one CPU its collections took and how many it ran
each second, by generation (0, 1 and the full one, 2), over the whole run or, with --levels AIPERF_LOG
(scripts/bench_aiperf.py's output), over each level's span apart (`16` and `16#2` of a `--concurrency 16 256 16` run).
A scheduler that collects more under the same load steps slower: its loop is one thread.

    python scripts/gc_report.py /tmp/gc --levels /tmp/goals/aiperf.log --title scheduler
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_steps import aiperf_levels, clock, read_lines  # noqa: E402

GENERATIONS = 3


@dataclass(frozen=True)
class Sample:
    """One line of a probe's file: a process's totals at a moment."""
    clock_s: int
    counts: tuple[int, ...]
    seconds: tuple[float, ...]


@dataclass
class Process:
    pid: int
    label: str
    samples: list[Sample]


def label_of(line: dict) -> str:
    """What tells the process apart on a machine of several systems: its title, its GPU, its parent's command."""
    title = " ".join((line.get("title") or "?").split())
    parent = (line.get("parent") or "").split()
    # The parent's most telling words: `-m sglang.launch_server ... --port 30000`, `workers.cli worker decode`.
    port = next((parent[i + 1] for i, word in enumerate(parent[:-1]) if word == "--port"), None)
    parent_hint = f"port {port}" if port else " ".join(parent[1:4])[:40]
    gpu = line.get("gpu")
    return f"{title[:50]} [gpu {gpu if gpu is not None else '-'}; parent {parent_hint}]"


def read_probe(folder: Path) -> list[Process]:
    processes = []
    for path in sorted(folder.glob("gc-*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue  # a line cut short by a process killed mid-write
        if not lines:
            continue
        samples = [Sample(line["clock_s"], tuple(line["counts"]), tuple(line["seconds"])) for line in lines]
        # The title as last read: SGLang renames its processes after start-up.
        processes.append(Process(lines[-1]["pid"], label_of(lines[-1]), samples))
    return processes


def between(process: Process, start_s: int, end_s: int) -> tuple[float, list[float], list[float]] | None:
    """(span seconds, GC seconds by generation, collections by generation) between the samples nearest inside
    [start_s, end_s]; None where fewer than two samples fall inside."""
    inside = [sample for sample in process.samples if start_s <= sample.clock_s <= end_s]
    if len(inside) < 2 or inside[-1].clock_s <= inside[0].clock_s:
        return None
    first, last = inside[0], inside[-1]
    span_s = float(last.clock_s - first.clock_s)
    seconds = [last.seconds[g] - first.seconds[g] for g in range(GENERATIONS)]
    counts = [float(last.counts[g] - first.counts[g]) for g in range(GENERATIONS)]
    return span_s, seconds, counts


def print_span(title: str, processes: list[Process], start_s: int, end_s: int) -> None:
    rows = []
    for process in processes:
        measured = between(process, start_s, end_s)
        if measured is None:
            continue
        span_s, seconds, counts = measured
        share = sum(seconds) / span_s
        rows.append((share, process, span_s, seconds, counts))
    print(f"\n{title}")
    if not rows:
        print("  (no process has two samples in this span)")
        return
    print(f"  {'GC % of a CPU':>13} {'gen0 %':>7} {'gen1 %':>7} {'gen2 %':>7} {'gen0/s':>7} {'gen1/s':>7} "
          f"{'gen2/s':>7} {'span s':>6}  process")
    for share, process, span_s, seconds, counts in sorted(rows, key=lambda row: -row[0]):
        by_gen = " ".join(f"{100 * seconds[g] / span_s:7.2f}" for g in range(GENERATIONS))
        rates = " ".join(f"{counts[g] / span_s:7.1f}" for g in range(GENERATIONS))
        print(f"  {100 * share:13.2f} {by_gen} {rates} {span_s:6.0f}  {process.pid} {process.label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="CONVEYOR_GC_PROBE_DIR of the run")
    parser.add_argument("--levels", type=Path, metavar="AIPERF_LOG", default=None,
                        help="one table per level of this bench_aiperf.py log")
    parser.add_argument("--title", default="", help="only processes whose title holds this text, e.g. scheduler")
    args = parser.parse_args()
    processes = [process for process in read_probe(args.folder) if args.title in process.label]
    if not processes:
        sys.exit(f"no probe files with {args.title!r} in their title under {args.folder}")
    if args.levels is None:
        start_s = min(sample.clock_s for process in processes for sample in process.samples)
        end_s = max(sample.clock_s for process in processes for sample in process.samples)
        print_span(f"whole run, {clock(start_s)}-{clock(end_s)}", processes, start_s, end_s)
        return
    for level in aiperf_levels(read_lines(args.levels)):
        print_span(f"level {level.label}: {clock(level.start_s)}-{clock(level.end_s)}", processes,
                   level.start_s, level.end_s)


if __name__ == "__main__":
    main()
