"""A stack's SGLang engine against the server's, round by round: before the worker's first canary of the round, and
after it.

Until the twenty-ninth stop a decode worker sent its canary (a 1-token greedy request) every 30 s, under load too.
SGLang schedules with overlap: a prefill batch joins the running batch before its results are read, so the canary
joined while still unfinished, and its sampling flags (greedy: top-k 1) were OR-ed into the running batch's and never
cleared. Every later step of that batch took SGLang's slower top-k/top-p sampling path, until the batch emptied at the
end of the round. This reads both engines' own log lines (`sglang_steps.py` explains them) and splits each round at
the stack's first canary prefill while requests run (`canary_seconds` says how it is told).

    python scripts/steps_around_canaries.py docs/results/2026-11-26-h100-e/1-helpers-off-256

`--against server2` compares the stack with a second SGLang server given the stack's engine settings, where a run
had one. A round is a stretch of the server's decode lines with no gap over --gap-s. Only steady windows count:
those running at least 90% of the most each engine ran in the round (a draining round's fewer requests step faster).
The ratio is the stack's steps a second per running request over the server's in the same seconds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_steps import decode_windows, read_lines, second_of  # noqa: E402

# A prefill batch while other requests run. The canary's prompt is not aiperf's chat template, so none of it is cached:
# alone, it is one sequence of 16 new tokens and none cached; batched with live requests (each finding its 16-token
# template prefix cached), one page fewer cached tokens than sequences. Only an isolated such batch counts: at a round's
# start many live requests find nothing cached yet, in bursts of lines within a second or two.
_PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), .*#running-req: [1-9]")
PAGE_TOKENS = 16
ISOLATED_S = 2
STEADY_SHARE = 0.9


def canary_seconds(lines: list[str]) -> list[int]:
    alone: list[int] = []
    one_uncached: list[int] = []
    uncached: list[int] = []  # every prefill batch with a sequence that found nothing cached
    for line in lines:
        prefill, second = _PREFILL.search(line), second_of(line)
        if prefill is None or second is None:
            continue
        sequences, new_tokens, cached_tokens = (int(prefill[index]) for index in (1, 2, 3))
        if (sequences, new_tokens, cached_tokens) == (1, PAGE_TOKENS, 0):
            alone.append(second)
        elif cached_tokens < PAGE_TOKENS * sequences:
            uncached.append(second)
            if cached_tokens == PAGE_TOKENS * (sequences - 1):
                one_uncached.append(second)
    batched = [second for second in one_uncached
               if sum(abs(other - second) <= ISOLATED_S for other in uncached) == 1]
    return sorted(alone + batched)


def rates_of(lines: list[str]) -> list[tuple[int, float, int]]:
    """(second, steps a second per running request, running requests) of each decode window."""
    return [(window.second, window.tokens_per_s / window.running, window.running) for window in decode_windows(lines)
            if window.second is not None and window.running > 0]


def steady(rates: list[tuple[int, float, int]], first_s: int, last_s: int) -> list[tuple[int, float]]:
    """The windows of one round that ran at least STEADY_SHARE of the most it ran."""
    inside = [rate for rate in rates if first_s <= rate[0] <= last_s]
    most = max((running for _, _, running in inside), default=0)
    return [(second, rate) for second, rate, running in inside if running >= STEADY_SHARE * most]


def rounds(rates: list[tuple[int, float, int]], gap_s: int) -> list[tuple[int, int]]:
    """(first, last second) of each stretch of windows with no gap over `gap_s`."""
    spans: list[tuple[int, int]] = []
    for second, _, _ in rates:
        if spans and second - spans[-1][1] <= gap_s:
            spans[-1] = (spans[-1][0], second)
        else:
            spans.append((second, second))
    return spans


def mean_between(rates: list[tuple[int, float]], start_s: float, end_s: float) -> float | None:
    values = [rate for second, rate in rates if start_s <= second < end_s]
    return statistics.mean(values) if values else None


def ratio(stack: float | None, server: float | None) -> float | None:
    return stack / server if stack is not None and server else None


def shown(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


@dataclass
class Ratios:
    """Each round's ratios, gathered over every run folder read."""

    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    without_canary: list[float] = field(default_factory=list)

    def summary(self) -> list[str]:
        def median(name: str, values: list[float]) -> str:
            if not values:
                return f"{name}: -"
            return (f"{name}: {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}), "
                    f"{len(values)} rounds")
        return [median("before the first canary", self.before), median("after it", self.after),
                median("rounds with no canary", self.without_canary)]


def split_rounds(server_lines: list[str], stack_lines: list[str], gap_s: int, settle_s: int,
                 ratios: Ratios) -> list[str]:
    """One printed row a round; each ratio is also added to `ratios`."""
    server_rates, stack_rates = rates_of(server_lines), rates_of(stack_lines)
    canaries = canary_seconds(stack_lines)
    rows = []
    for first_s, last_s in rounds(server_rates, gap_s):
        if last_s - first_s < 3 * settle_s:
            continue
        server, stack = steady(server_rates, first_s, last_s), steady(stack_rates, first_s, last_s)
        inside = [second - first_s for second in canaries if first_s <= second <= last_s]
        split_s = first_s + inside[0] if inside else last_s + 1
        start_s = first_s + settle_s
        before = ratio(mean_between(stack, start_s, split_s), mean_between(server, start_s, split_s))
        # The windows stamped just after the canary still hold steps from before it.
        after_s = split_s + 3
        after = ratio(mean_between(stack, after_s, last_s + 1), mean_between(server, after_s, last_s + 1)) \
            if inside else None
        for values, value in ((ratios.before, before), (ratios.after, after),
                              (ratios.without_canary, before if not inside else None)):
            if value is not None:
                values.append(value)
        clock = f"{first_s // 3600:02d}:{first_s % 3600 // 60:02d}:{first_s % 60:02d}"
        rows.append(f"{clock:>8}  {last_s - first_s:>3}  {shown(before):>24}  {shown(after):>16}  {inside}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", type=Path, nargs="+",
                        help="gpu_goals.sh result folders (server-batches.log[.xz] and more); with several, the "
                             "medians over all their rounds follow")
    parser.add_argument("--stack", default="conveyor", help="which stack's batch log: conveyor (stack a), b or c")
    parser.add_argument("--against", default="server", help="the engine it is compared with: server, or server2 "
                        "(a second SGLang server started with the stack's engine settings: what SGLang alone does "
                        "with them)")
    parser.add_argument("--gap-s", type=int, default=15, help="a pause longer than this ends a round")
    parser.add_argument("--settle-s", type=int, default=5, help="seconds of each round's start left out")
    args = parser.parse_args()

    def log_of(run_dir: Path, name: str) -> list[str]:
        for path in (run_dir / f"{name}-batches.log.xz", run_dir / f"{name}-batches.log"):
            if path.exists():
                return read_lines(path)
        parser.error(f"no {name}-batches.log[.xz] in {run_dir}")

    ratios = Ratios()
    print(f"{'round':>8}  {'s':>3}  {'before its first canary':>24}  {'after it':>16}  canaries (s into the round)")
    for run_dir in args.run_dirs:
        if len(args.run_dirs) > 1:
            print(f"{run_dir}:")
        rows = split_rounds(log_of(run_dir, args.against), log_of(run_dir, args.stack), args.gap_s, args.settle_s,
                            ratios)
        print("\n".join(rows))
    if len(args.run_dirs) > 1:
        print(f"{args.stack} over {args.against}, medians: " + "; ".join(ratios.summary()))


if __name__ == "__main__":
    main()
