"""How many of issue 11's goals each system of one bench_aiperf run meets against each other system of that run.

Reads the results file bench_aiperf writes (`--out`/results.json; `aiperf-results.json` in gpu_goals.sh's output) and
reads the goals off the medians over rounds exactly as bench_aiperf's own goal lines do, for every ordered pair of
systems (groups included). Where a run holds two instances of one system (the server and `server2` with the same
arguments; two stacks set up alike), the rows they meet against each other are the method's floor on that machine:
a system cannot be expected to meet more rows against the server than the server's twin does.

    python3 scripts/goals_noise.py docs/results/2026-11-27-h100x4-v/one-run/aiperf-results.json
    python3 scripts/goals_noise.py RESULTS --pair server2=sglang --pair b=conveyor   # each pair's misses, row by row
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_aiperf import GoalCheck, goal_checks  # noqa: E402
from bench_vs_sglang import median_row  # noqa: E402
from profile_processes import named  # noqa: E402

Rounds = dict[str, list[dict[str, float]]]  # system name → one row of measures per round


def load_levels(path: Path) -> dict[str, Rounds]:
    """Each level's rounds, by the level's name as bench_aiperf wrote it ("16", or "16#2" for a second pass)."""
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (bench_aiperf writes results.json under its --out)")
    levels = json.loads(path.read_text())["levels"]
    if not levels:
        raise SystemExit(f"{path}: no levels in it")
    return levels


def concurrency_of(level_name: str) -> int:
    return int(level_name.partition("#")[0])


def pair_checks(levels: dict[str, Rounds], mine: str, reference: str) -> list[tuple[str, GoalCheck]]:
    """Every goal of every level, `mine` against `reference`, each with its level's name."""
    return [(level_name, check)
            for level_name, rounds in levels.items()
            for check in goal_checks(concurrency_of(level_name), median_row(rounds[mine]),
                                     median_row(rounds[reference]))]


def systems_of(levels: dict[str, Rounds]) -> list[str]:
    """The systems every level ran, in the file's order."""
    first, *rest = levels.values()
    return [name for name in first if all(name in rounds for rounds in rest)]


def print_matrix(levels: dict[str, Rounds]) -> None:
    systems = systems_of(levels)
    width = max(len(name) for name in systems) + 2
    print(f"rows met, each row's system against each column's ({', '.join(levels)} streams)")
    print(" " * width + "".join(f"{name:>{width}}" for name in systems))
    for mine in systems:
        cells = []
        for reference in systems:
            checks = [check for _, check in pair_checks(levels, mine, reference)]
            cells.append("-" if mine == reference else f"{sum(check.met for check in checks)}/{len(checks)}")
        print(f"{mine:<{width}}" + "".join(f"{cell:>{width}}" for cell in cells))


def print_pair(levels: dict[str, Rounds], mine: str, reference: str) -> None:
    checks = pair_checks(levels, mine, reference)
    print(f"\n{mine} against {reference}: {sum(check.met for _, check in checks)} of {len(checks)} met")
    for level_name, check in checks:
        print(f"  c={level_name:<4} {check.line()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="bench_aiperf's results.json (aiperf-results.json)")
    parser.add_argument("--pair", type=named, action="append", default=[], metavar="MINE=REFERENCE",
                        help="also list each goal of this pair, met or not (repeat for more pairs)")
    args = parser.parse_args()
    levels = load_levels(args.results)
    known = systems_of(levels)
    for mine, reference in args.pair:
        if unknown := {mine, reference} - set(known):
            parser.error(f"not in every level of {args.results}: {', '.join(sorted(unknown))} "
                         f"(the systems: {', '.join(known)})")
    print_matrix(levels)
    for mine, reference in args.pair:
        print_pair(levels, mine, reference)


if __name__ == "__main__":
    main()
