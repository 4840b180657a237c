"""How fast each SGLang engine stepped under load, read from its own log: the server's and Conveyor's side by side.

aiperf sees tokens at the client; it cannot tell an engine that steps slower from a pipeline that delivers late. SGLang
logs a line every 40 decode steps (`Decode batch, #running-req: N, ... gen throughput (token/s): T`) when it runs at
log level info; T over N is how many steps a second each running request got, whatever the pipeline does after.
`scripts/gpu_goals.sh wait` collects these lines (server-batches.log, conveyor-batches.log) when the engines log at
info, as every engine `gpu_hold.sh` starts does (elsewhere: `--log-level info` for the server, `"log_level": "info"`
in a stack's CONVEYOR_SGLANG_EXTRA_SERVER_ARGS).

    python scripts/sglang_steps.py server=server-batches.log conveyor=conveyor-batches.log --min-running 32

Lines with fewer than --min-running requests (warm-up, a round's tail, idle gaps) are left out, and with
--max-running those with more: `--min-running 1 --max-running 1` reads one stream's steps, where a step is short and
any CPU work in the scheduler's loop shows (docs/performance.md, thirty-first stop). Files may be xz-compressed (.xz).
The ratios are each engine's over the first one named. With --levels AIPERF_LOG (scripts/bench_aiperf.py's output), one
table per level of that run instead, each from the lines logged while the level's rounds ran and at 75–100% of its
streams running (or of the most the first engine ran there, where its limit is lower): `16` and `16#2` of a
`--concurrency 16 256 16` run apart.

    python scripts/sglang_steps.py server=server-batches.log conveyor=conveyor-batches.log --levels aiperf.log

Two columns split a slower step rate: `decode step ms`, the median step of the windows with no prefill logged among
their steps (the decode step alone), and `ms a prefill`, what each prefill added to its window beyond that many decode
steps (the prefill's own step, mostly: a small model's prefill runs without CUDA graphs and its time is the
scheduler's CPU). An engine whose decode steps match and whose prefills cost more is slower where its Python runs
the forward eagerly (docs/performance.md, forty-sixth stop).
"""

from __future__ import annotations

import argparse
import lzma
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
_PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")
# SGLang stamps each line with its local time: [2026-11-26 04:27:34] (a scheduler's line may carry a rank after it).
_STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d)")
# A full pool evicts on the step path (a walk over the radix tree's leaves): how full each engine's pool ran.
_USAGE = re.compile(r"token usage: ([\d.]+)")
# bench_aiperf.py's progress: `[bench-aiperf 05:39:48] concurrency 16#2, round 1/3: sglang, conveyor together`.
_AIPERF_STAMP = re.compile(r"^\[bench-aiperf (\d\d):(\d\d):(\d\d)\]")
_AIPERF_ROUND = re.compile(r"\] concurrency (\d+)(#\d+)?, round \d+/\d+")
# SGLang logs a `Decode batch` line every this many decode steps (its --decode-log-interval default).
DECODE_LOG_STEPS = 40
# At least this share of a level's streams running: its steady windows, not its ramp or its drain.
STEADY_SHARE = 0.75


@dataclass(frozen=True)
class Window:
    """One `Decode batch` line: the last 40 decode steps."""
    running: int
    tokens_per_s: float
    token_usage: float | None  # the KV pool's fill, 0-1
    second: int | None  # of the clock (since midnight), where the line is stamped
    prefills_within: int = 0  # `Prefill batch` lines logged since the window before: 0, its steps were decode alone

    @property
    def step_ms(self) -> float:
        """One step's time, where the window's steps all ran `running` requests (a decode-only window's do)."""
        return 1000 * self.running / self.tokens_per_s if self.tokens_per_s > 0 else math.inf


def second_of(line: str) -> int | None:
    """The second of the clock (since midnight) a line is stamped with, where it is."""
    stamp = _STAMP.search(line)
    return int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3]) if stamp else None


def decode_windows(lines: list[str]) -> list[Window]:
    windows = []
    prefills = 0
    for line in lines:
        if not (decode := _DECODE.search(line)):
            prefills += 1 if _PREFILL.search(line) else 0
            continue
        usage = _USAGE.search(line)
        windows.append(Window(
            running=int(decode[1]), tokens_per_s=float(decode[2]), token_usage=float(usage[1]) if usage else None,
            second=second_of(line), prefills_within=prefills))
        prefills = 0
    return windows


@dataclass(frozen=True)
class EngineSteps:
    name: str
    windows: int  # 40-step windows with at least --min-running requests
    mean_running: float
    tokens_per_s: float  # median over the windows
    steps_per_s_per_request: float  # median of tokens/s over running requests, window by window
    prefill_batches: int
    sequences_per_prefill: float
    new_tokens_per_prefill: float  # prompt tokens computed per prefill batch (cached ones not)
    cached_tokens_per_prefill: float  # prompt tokens found in the radix cache per prefill batch
    mean_token_usage: float  # the KV pool's fill over the loaded windows, 0-1
    # Windows with no prefill among their 40 steps, and their median step (ms): the decode step alone, so a slower
    # engine shows whether its decode steps are slower or its prefills cost its running requests more.
    decode_only_windows: int
    decode_only_step_ms: float
    # What each prefill added to its window beyond DECODE_LOG_STEPS decode-only steps (median over the windows with
    # one or more): the prefill's own step, and the time its slot was empty between a request and the next.
    prefill_cost_ms: float


def read_lines(path: Path) -> list[str]:
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rt", errors="replace") as lines:
        return list(lines)


class NoLoadedWindows(ValueError):
    """An engine's log has no decode line in the running-request range asked for."""


def engine_steps(name: str, lines: list[str], min_running: int, max_running: int | None = None) -> EngineSteps:
    loaded = [window for window in decode_windows(lines) if counted(window, min_running, max_running)]
    if not loaded:
        most = "+" if max_running is None else f" to {max_running}"
        raise NoLoadedWindows(f"{name}: no decode line with {min_running}{most} running requests "
                              "(does it log at info?)")
    prefills = [(int(m[1]), int(m[2]), int(m[3])) for line in lines if (m := _PREFILL.search(line))]
    usage = [window.token_usage for window in loaded if window.token_usage is not None]
    decode_only = [window.step_ms for window in loaded if window.prefills_within == 0]
    decode_step_ms = statistics.median(decode_only) if decode_only else math.nan
    prefill_costs = [DECODE_LOG_STEPS * (window.step_ms - decode_step_ms) / window.prefills_within
                     for window in loaded if window.prefills_within > 0] if decode_only else []
    return EngineSteps(
        name=name,
        windows=len(loaded),
        mean_running=statistics.fmean(window.running for window in loaded),
        tokens_per_s=statistics.median(window.tokens_per_s for window in loaded),
        steps_per_s_per_request=statistics.median(window.tokens_per_s / window.running for window in loaded),
        prefill_batches=len(prefills),
        sequences_per_prefill=statistics.fmean(seqs for seqs, _, _ in prefills) if prefills else 0.0,
        new_tokens_per_prefill=statistics.fmean(new for _, new, _ in prefills) if prefills else 0.0,
        cached_tokens_per_prefill=statistics.fmean(cached for _, _, cached in prefills) if prefills else 0.0,
        mean_token_usage=statistics.fmean(usage) if usage else 0.0,
        decode_only_windows=len(decode_only),
        decode_only_step_ms=decode_step_ms,
        prefill_cost_ms=statistics.median(prefill_costs) if prefill_costs else math.nan,
    )


def counted(window: Window, min_running: int, max_running: int | None) -> bool:
    return window.running >= min_running and (max_running is None or window.running <= max_running)


def steps_by_time(lines: list[str], min_running: int, bucket_s: int,
                  max_running: int | None = None) -> dict[int, float]:
    """Median steps/s per running request in each bucket_s of the clock (key: the bucket's start, seconds since
    midnight), from loaded windows only: engines measured at the same time (bench_aiperf.py --together) compare
    bucket by bucket, and engines measured in turn show how far one engine's rate moved between rounds."""
    buckets: dict[int, list[float]] = {}
    for window in decode_windows(lines):
        if window.second is not None and counted(window, min_running, max_running):
            start = window.second - window.second % bucket_s
            buckets.setdefault(start, []).append(window.tokens_per_s / window.running)
    return {start: statistics.median(rates) for start, rates in sorted(buckets.items())}


@dataclass(frozen=True)
class LevelSpan:
    """When one level of a bench_aiperf.py run ran, by the clock (seconds since midnight)."""
    label: str  # "16", or "16#2" for a level's second pass in the run
    concurrency: int
    start_s: int
    end_s: int


def aiperf_levels(lines: list[str]) -> list[LevelSpan]:
    """Each level of a bench_aiperf.py log, from its first round's start to the next level's (the last level: to the
    log's last stamped line)."""
    starts: list[tuple[str, int, int]] = []
    last_s = 0
    for line in lines:
        if not (stamp := _AIPERF_STAMP.search(line)):
            continue
        last_s = int(stamp[1]) * 3600 + int(stamp[2]) * 60 + int(stamp[3])
        if not (level := _AIPERF_ROUND.search(line)):
            continue
        label = level[1] + (level[2] or "")
        if label not in (seen for seen, _, _ in starts):
            starts.append((label, int(level[1]), last_s))
    ends = [start_s for _, _, start_s in starts[1:]] + [last_s]
    return [LevelSpan(label, concurrency, start_s, end_s)
            for (label, concurrency, start_s), end_s in zip(starts, ends)]


def lines_within(lines: list[str], start_s: int, end_s: int) -> list[str]:
    return [line for line in lines if (second := second_of(line)) is not None and start_s <= second <= end_s]


def print_by_time(names: list[str], rates: list[dict[int, float]], bucket_s: int) -> None:
    print(f"\nsteps/s per request, {bucket_s} s buckets (ratio: each over {names[0]}, where both ran)")
    print(f"{'from':<8} " + " ".join(f"{name:>14}" for name in names))
    for start in sorted(set().union(*rates)):
        cells = []
        for index, engine_rates in enumerate(rates):
            if start not in engine_rates:
                cells.append(f"{'':>14}")
            elif index == 0 or start not in rates[0]:
                cells.append(f"{engine_rates[start]:>14.0f}")
            else:
                cells.append(f"{engine_rates[start]:>8.0f} {engine_rates[start] / rates[0][start]:.2f}x")
        print(f"{clock(start)} " + " ".join(cells))


def named_path(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", type=named_path, help="NAME=PATH of an engine's batch lines")
    parser.add_argument("--min-running", type=int, default=32, help="fewest running requests a window counts with")
    parser.add_argument("--max-running", type=int, default=None,
                        help="most running requests a window counts with (default: no limit)")
    parser.add_argument("--by-time", type=int, metavar="SECONDS", default=0,
                        help="also each engine's rate in buckets of this many seconds of the clock, side by side")
    parser.add_argument("--levels", type=Path, metavar="AIPERF_LOG", default=None,
                        help="one table per level of this bench_aiperf.py run (its running-request range: 75-100%% "
                             "of the level's streams; --min-running and --max-running are then ignored)")
    args = parser.parse_args()

    logs = {name: read_lines(path) for name, path in args.logs}
    if args.levels is not None:
        for level in aiperf_levels(read_lines(args.levels)):
            within = {name: lines_within(lines, level.start_s, level.end_s) for name, lines in logs.items()}
            # An engine's running-request limit caps what a level can run (128 of 256 streams, say).
            most = max((window.running for window in decode_windows(next(iter(within.values())))), default=0)
            min_running = max(1, math.ceil(STEADY_SHARE * min(level.concurrency, most)))
            print(f"\nlevel {level.label}: {min_running} to {level.concurrency} running, "
                  f"{clock(level.start_s)}-{clock(level.end_s)}")
            try:
                print_table(within, min_running, level.concurrency)
            except NoLoadedWindows as missing:
                print(f"{missing}: no ratio at this level")
        return
    try:
        shown = print_table(logs, args.min_running, args.max_running)
    except NoLoadedWindows as missing:
        parser.exit(1, f"{missing}\n")
    if args.by_time:
        rates = [steps_by_time(logs[name], args.min_running, args.by_time, args.max_running) for name in shown]
        print_by_time(shown, rates, args.by_time)


def clock(second: int) -> str:
    return f"{second // 3600:02d}:{second % 3600 // 60:02d}:{second % 60:02d}"


def print_table(logs: dict[str, list[str]], min_running: int, max_running: int | None) -> list[str]:
    """Each engine's steps over its loaded windows, and its ratio to the first's; returns the engines shown. An engine
    with none (one held but idle in this run, as a second stack beside a two-system run) is said on stderr and left
    out; the first one with none raises NoLoadedWindows (no ratio can be read without it)."""
    engines: list[EngineSteps] = []
    for name, lines in logs.items():
        try:
            engines.append(engine_steps(name, lines, min_running, max_running))
        except NoLoadedWindows as missing:
            if not engines:
                raise
            print(f"{missing}; left out", file=sys.stderr)
    base = engines[0]
    print(f"{'engine':<12} {'windows':>7} {'running':>8} {'tok/s':>14} {'steps/s per request':>22} "
          f"{'prefills':>9} {'seqs/prefill':>12} {'new tok/prefill':>15} {'cached tok/prefill':>18} {'pool used':>9} "
          f"{'decode-only':>11} {'decode step ms':>15} {'ms a prefill':>14}")
    for engine in engines:
        first = engine is base
        tokens = ratio_of(first, engine.tokens_per_s, base.tokens_per_s)
        steps = ratio_of(first, engine.steps_per_s_per_request, base.steps_per_s_per_request)
        decode_step = ratio_of(first, engine.decode_only_step_ms, base.decode_only_step_ms)
        prefill = ratio_of(first, engine.prefill_cost_ms, base.prefill_cost_ms)
        print(f"{engine.name:<12} {engine.windows:>7} {engine.mean_running:>8.1f} "
              f"{engine.tokens_per_s:>8.0f}{tokens:<6} {engine.steps_per_s_per_request:>15.1f}{steps:<7} "
              f"{engine.prefill_batches:>9} {engine.sequences_per_prefill:>12.2f} "
              f"{engine.new_tokens_per_prefill:>15.0f} {engine.cached_tokens_per_prefill:>18.0f} "
              f"{engine.mean_token_usage:>9.2f} {engine.decode_only_windows:>11} "
              f"{engine.decode_only_step_ms:>8.3f}{decode_step:<7} {engine.prefill_cost_ms:>7.1f}{prefill:<7}")
    return [engine.name for engine in engines]


def ratio_of(is_base: bool, mine: float, theirs: float) -> str:
    """An engine's figure over the first engine's ("" for the first engine, or where either has none)."""
    if is_base or not (math.isfinite(mine) and math.isfinite(theirs)) or theirs <= 0:
        return ""
    return f" {mine / theirs:.2f}x"


if __name__ == "__main__":
    main()
