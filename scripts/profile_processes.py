"""Profile running processes while they are under load: where their CPU goes, and how late their event loops run.

Once the process named by --when-busy uses more than --busy-percent of a core (a load client is past its start-up),
py-spy records every named process for --duration-s. Meanwhile each one's CPU is sampled every second (its threads
together, children not), and each --metrics page's `conveyor_event_loop_lag_seconds` is read at both ends of the
window. It prints, per process: CPU mean and max, the loop's lag over the window, and the functions holding the most
samples, by their own time and with their callees.

    python scripts/profile_processes.py decode=4242 gateway=4243 --when-busy decode \\
        --metrics decode=http://127.0.0.1:9102/metrics --duration-s 10 --out /tmp/profiles

py-spy must be on the PATH (scripts/gpu_prepare.sh carries it for the GPU machine; elsewhere `pip install py-spy`).
The raw profiles (collapsed stacks) stay under --out, one per process, for a flame graph.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

LAG_METRIC = "conveyor_event_loop_lag_seconds"
_LINE = re.compile(r":\d+\)$")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def say(message: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def named(text: str) -> tuple[str, str]:
    name, separator, value = text.partition("=")
    if not separator or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, not {text!r}")
    return name, value


def cpu_seconds(pid: int) -> float:
    """User plus system time of the process so far (all its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime: fields 14 and 15 of stat(5)


def busy_percent(pid: int, over_s: float = 1.0) -> float:
    start = cpu_seconds(pid)
    time.sleep(over_s)
    return 100.0 * (cpu_seconds(pid) - start) / over_s


def lag_histogram(url: str) -> dict[str, float]:
    """The lag histogram's cumulative buckets, its count and its sum, keyed by sample name (and `le`)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith(LAG_METRIC):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def lag_over_window(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Count, mean, and the share of timers that fired more than 1 / 5 / 10 / 50 ms late, between two reads."""
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    count = delta.get(f"{LAG_METRIC}_count", 0.0)
    if not count:
        return {"timers": 0}
    late = {f"over_{ms}ms": round(1 - delta.get(f'{LAG_METRIC}_bucket{{le="{ms / 1000}"}}', count) / count, 3)
            for ms in (1, 5, 10, 50)}
    return {"timers": int(count), "mean_ms": round(1000 * delta[f"{LAG_METRIC}_sum"] / count, 2), **late}


def top_functions(raw_profile: Path, limit: int) -> dict[str, Any]:
    """From py-spy's collapsed stacks: samples in all, and the functions with the most, by their own samples
    (the stack's leaf) and with their callees (counted once per stack)."""
    own, inclusive, total = Counter[str](), Counter[str](), 0
    for line in raw_profile.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        # py-spy reads a live process's memory: now and then a frame's name is torn text with a newline in it.
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # "function (file.py:line)" per frame: counted per function, whatever its line.
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        total += count
        if frames:
            own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count

    def shares(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(count / max(total, 1), 3)) for frame, count in counter.most_common(limit)]

    return {"samples": total, "own": shares(own), "inclusive": shares(inclusive)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("processes", nargs="+", type=named, help="NAME=PID of each process to record")
    parser.add_argument("--when-busy", default=None, help="NAME of the process whose load opens the window "
                        "(default: the first)")
    parser.add_argument("--busy-percent", type=float, default=40.0, help="CPU share of one core that counts as loaded")
    parser.add_argument("--wait-s", type=float, default=180.0, help="how long to wait for that load before giving up")
    parser.add_argument("--duration-s", type=int, default=10, help="length of the recorded window")
    parser.add_argument("--rate-hz", type=int, default=100, help="py-spy's samples per second")
    parser.add_argument("--metrics", nargs="*", type=named, default=[], help="NAME=URL of a process's /metrics")
    parser.add_argument("--top", type=int, default=15, help="functions listed per process")
    parser.add_argument("--out", type=Path, default=Path("/tmp/profiles"))
    args = parser.parse_args()

    py_spy = shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is not on the PATH: pip install py-spy")
    pids = {name: int(pid) for name, pid in args.processes}
    trigger = args.when_busy or next(iter(pids))
    args.out.mkdir(parents=True, exist_ok=True)
    say(f"waiting for {trigger} (pid {pids[trigger]}) to pass {args.busy_percent:.0f}% of a core")
    deadline = time.monotonic() + args.wait_s
    while busy_percent(pids[trigger]) < args.busy_percent:
        if time.monotonic() > deadline:
            sys.exit(f"{trigger} did not get busy within {args.wait_s:.0f} s")
    say(f"recording {', '.join(pids)} for {args.duration_s} s")
    lag_before = {name: lag_histogram(url) for name, url in args.metrics}
    recorders = {name: subprocess.Popen([py_spy, "record", "--nonblocking", "--pid", str(pid), "--rate",
                                         str(args.rate_hz), "--duration", str(args.duration_s), "--format", "raw",
                                         "--output", str(args.out / f"profile-{name}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for name, pid in pids.items()}
    cpu: dict[str, list[float]] = {name: [] for name in pids}
    last = {name: cpu_seconds(pid) for name, pid in pids.items()}
    for _ in range(args.duration_s):
        time.sleep(1.0)
        for name, pid in pids.items():
            now = cpu_seconds(pid)
            cpu[name].append(100.0 * (now - last[name]))
            last[name] = now
    lag = {name: lag_over_window(lag_before[name], lag_histogram(url)) for name, url in args.metrics}
    report: dict[str, Any] = {}
    for name, recorder in recorders.items():
        _, stderr = recorder.communicate(timeout=args.duration_s + 60)
        profile = args.out / f"profile-{name}.txt"
        report[name] = {
            "cpu_percent_mean": round(sum(cpu[name]) / len(cpu[name]), 1),
            "cpu_percent_max": round(max(cpu[name]), 1),
            "event_loop_lag": lag.get(name),
            "profile": top_functions(profile, args.top) if profile.exists() else stderr[-500:],
        }
    (args.out / "profile-report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
