"""SGLang's own server versus Conveyor, driven by NVIDIA's aiperf: the second load client issue 11 names.

Both servers must already be running (docs/gpu.md: `scripts/gpu_hold.sh server`, then `stack a`). For each
concurrency and round, `aiperf profile` streams chat completions at each URL in turn, in its own processes, with the
same synthetic prompts (one seed per round and level, fresh per run; each round runs the last one's order in
reverse, so that each system runs before and after each other one equally often; with --together all systems run
at once, each round's ratio then paired in time). The prompt and output lengths
follow issue 11: 128–1024 prompt tokens, 128–512 output tokens (`ignore_eos`, so every request runs to its length on
either server). It prints each system's median round and its ratios to the first URL,
and each round's tok/s ratio and ITL p99 beside its TTFT p50; where each run's slowest first tokens started; and at
the end issue 11's goals, each read off the run's medians (met or not). --together-from runs the levels of many
streams together and the rest one after another, so one run covers every goal:

    bash scripts/gpu_run.sh python3 scripts/bench_aiperf.py --tokenizer .gpu/smol \\
        sglang=http://127.0.0.1:30000 conveyor=http://127.0.0.1:8000 --concurrency 256 128 64 16 1 \\
        --together-from 16 --rounds 2 --requests-per-stream 8

--group NAME=A,B measures a system as the mean of several instances of it, each round: with `--group sglang=server,
server2 --group conveyor=a,b` (four targets, a GPU each) the goals are read off the groups, the first the reference.
On the H100 machines one instance's pace moves by tens of percent with the vCPU its scheduler runs on
(docs/performance.md, forty-third stop); two of each halve that spread's weight, and each pair's own ratio, printed
beside, shows it in the same run.

aiperf is taken from `python3 -m aiperf` (scripts/gpu_prepare.sh packs it for the GPU machine; elsewhere
`pip install aiperf`). Each run's artifacts go under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_sglang import median_row, round_order  # noqa: E402

# The measures read from aiperf's summary (profile_export_aiperf.json): name in the table → (metric, statistic).
MEASURES = {
    "tok/s": ("output_token_throughput", "avg"),
    "TTFT p50": ("time_to_first_token", "p50"),
    "TTFT p99": ("time_to_first_token", "p99"),
    "ITL p50": ("inter_token_latency", "p50"),
    "ITL p99": ("inter_token_latency", "p99"),
    # aiperf's ITL is per request ((end - first token) / (tokens - 1)); this is every gap between two chunks, as
    # bench_serving computes its ITL: a stall shared by all streams shows here and hardly in the per-request figure.
    "gap p99": ("inter_chunk_latency", "p99"),
}
# Issue 11's load: prompts of 128–1024 tokens, outputs of 128–512 (aiperf draws uniformly from mean·(1 ± ratio)).
INPUT_TOKENS_MEAN, INPUT_RANGE_RATIO = 576, 0.778
# The id aiperf loads the tokenizer by, from a cache of our own (offline_tokenizer_cache).
TOKENIZER_REPO = "conveyor-bench/tokenizer"
OUTPUT_TOKENS_MEAN, OUTPUT_RANGE_RATIO = 320, 0.6


def say(message: str) -> None:
    print(f"[bench-aiperf {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_target(text: str) -> tuple[str, str]:
    name, separator, url = text.partition("=")
    if not separator or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"a target is NAME=URL (e.g. sglang=http://127.0.0.1:30000), not {text!r}")
    return name, url.rstrip("/")


def parse_level_number(text: str) -> tuple[int, int]:
    """STREAMS=N, a number of one level's own (--requests-per-stream-at, --rounds-at)."""
    streams, separator, number = text.partition("=")
    if not separator or not streams.isdigit() or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"give STREAMS=N with N at least 1 (e.g. 16=24), not {text!r}")
    return int(streams), int(number)


def aiperf_command(args: argparse.Namespace, url: str, concurrency: int, seed: int, out_dir: Path) -> list[str]:
    per_stream = args.requests_per_stream_at.get(concurrency, args.requests_per_stream)
    num_requests = max(args.min_requests, per_stream * concurrency)
    return [
        sys.executable, "-m", "aiperf", "profile",
        "--model", args.model_name, "--tokenizer", TOKENIZER_REPO, "--url", url,
        "--endpoint-type", "chat", "--streaming",
        "--concurrency", str(concurrency), "--request-count", str(num_requests),
        "--prompt-input-tokens-mean", str(INPUT_TOKENS_MEAN), "--prompt-output-tokens-mean", str(OUTPUT_TOKENS_MEAN),
        "--random-range-ratio", json.dumps({"input": INPUT_RANGE_RATIO, "output": OUTPUT_RANGE_RATIO}),
        "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed),
        "--output-artifact-dir", str(out_dir), "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
    ] + (["--workers-max", str(args.workers_max)] if args.workers_max else [])


def offline_tokenizer_cache(tokenizer_dir: Path, cache_dir: Path) -> Path:
    """An HF cache of our own in which the tokenizer folder is the snapshot of TOKENIZER_REPO; the cache's path.

    Why: aiperf given a folder loads it only online, and first loads it once more in a process of its own to "cache"
    it. Offline, aiperf skips the prefetch and finds a tokenizer only by repository id in the HF cache: this cache
    holds the folder's files under that id. On the H100 machine that took aiperf's start-up alone from 30.5 to 15.1 s
    (docs/performance.md, thirty-ninth stop)."""
    repo = cache_dir / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / "local"
    # Laid out afresh: an --out used before may hold another folder's files.
    shutil.rmtree(snapshot, ignore_errors=True)
    snapshot.mkdir(parents=True)
    for source in tokenizer_dir.resolve().iterdir():
        (snapshot / source.name).symlink_to(source)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text("local")
    return cache_dir


# Imported at start-up by every aiperf process (Python imports `sitecustomize` from its path): marks torch and
# scikit-learn as absent, so that transformers loads the tokenizer without importing them. aiperf needs neither;
# transformers imports both when it finds them, and on the H100 machine, where SGLang's torch is installed, that was
# most of the 14.6 s each aiperf took to load its tokenizer (`python -X importtime`: torch 6.4 s, scikit-learn 2.7 s).
HIDE_FROM_AIPERF = 'import sys\nfor _name in ("torch", "sklearn"):\n    sys.modules.setdefault(_name, None)\n'


def aiperf_site(site_dir: Path) -> Path:
    """A folder for the head of aiperf's PYTHONPATH, holding HIDE_FROM_AIPERF as its sitecustomize; the folder."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(HIDE_FROM_AIPERF)
    return site_dir


def aiperf_env(args: argparse.Namespace) -> dict[str, str]:
    """aiperf's environment: offline, with the tokenizer in args.hf_cache (offline_tokenizer_cache), and torch hidden
    by args.aiperf_site (aiperf_site)."""
    python_path = os.pathsep.join(filter(None, [str(args.aiperf_site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_CACHE": str(args.hf_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": python_path}


def start_aiperf(args: argparse.Namespace, url: str, concurrency: int, seed: int, out_dir: Path) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "aiperf.log", "wb") as log:
        return subprocess.Popen(aiperf_command(args, url, concurrency, seed, out_dir), stdout=log,
                                stderr=subprocess.STDOUT, env=aiperf_env(args))


def finish_aiperf(args: argparse.Namespace, process: subprocess.Popen, url: str, out_dir: Path,
                  started_s: float) -> dict[str, float]:
    """Wait for one aiperf run; the measures of its summary. A failed run, or one with failed requests, stops the
    benchmark: a ratio over a partial run would be meaningless."""
    try:
        returncode = process.wait(timeout=max(1.0, started_s + args.run_timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        raise RuntimeError(f"aiperf against {url} ran past --run-timeout-s {args.run_timeout_s:.0f}") from None
    summary_path = out_dir / "profile_export_aiperf.json"
    if returncode != 0 or not summary_path.exists():
        tail = (out_dir / "aiperf.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited {returncode} against {url}; its log ends:\n{tail}")
    summary = json.loads(summary_path.read_text())
    error_rate = summary.get("request_error_rate", {}).get("avg", 0.0)
    if error_rate:
        raise RuntimeError(f"{error_rate:.1f}% of requests failed against {url} (see {out_dir})")
    load_s = float(summary["benchmark_duration"]["avg"])
    launched_ns = time.time_ns() - int((time.monotonic() - started_s) * 1e9)
    say(f"  aiperf took {time.monotonic() - started_s:.0f} s, {load_s:.0f} s of it under load"
        f"{time_around_load(out_dir / 'profile_export.jsonl', launched_ns, time.time_ns())}")
    say(f"  {url}: {slowest_first_tokens(out_dir / 'profile_export.jsonl')}")
    return {name: float(summary[metric][statistic]) for name, (metric, statistic) in MEASURES.items()}


def profiling_records(records_path: Path) -> list[dict[str, Any]]:
    """aiperf's per-request records of a run's profiling phase that succeeded, each with its `metadata`."""
    records = []
    for record in map(json.loads, records_path.open()):
        record.setdefault("metadata", {})
        if not record.get("error") and record["metadata"].get("benchmark_phase", "profiling") == "profiling":
            records.append(record)
    return records


def time_around_load(records_path: Path, launched_ns: int, exited_ns: int) -> str:
    """Where a run's time outside its load went, from its requests' wall-clock stamps: from launch to the first
    request, and from the last response to exit (empty where there are no records). Runs this short spend most of
    their time there, so this is what a longer lease buys."""
    if not records_path.exists():
        return ""
    spans = [(int(record["metadata"]["request_start_ns"]), int(record["metadata"]["request_end_ns"]))
             for record in profiling_records(records_path) if "request_end_ns" in record["metadata"]]
    if not spans:
        return ""
    first_start_ns, last_end_ns = min(start for start, _ in spans), max(end for _, end in spans)
    return (f" ({(first_start_ns - launched_ns) / 1e9:.0f} s to its first request, "
            f"{(exited_ns - last_end_ns) / 1e9:.0f} s after its last response)")


def slowest_first_tokens(records_path: Path, tail_share: float = 0.01) -> str:
    """When a run's slowest first tokens (its TTFT p99 tail) were sent: each one's place in the order the requests
    started (#1 is the first) and its start after the first request's. A tail all within the first `concurrency`
    places is the opening burst's; one spread over the run is not."""
    if not records_path.exists():
        return f"no per-request records ({records_path.name} missing)"
    started = [(int(record["metadata"]["request_start_ns"]), float(ttft["value"]))  # (start in ns, TTFT in ms)
               for record in profiling_records(records_path)
               if (ttft := record.get("metrics", {}).get("time_to_first_token")) is not None]
    if not started:
        return "no successful requests in the records"
    started.sort()
    first_ns = started[0][0]
    num_tail = max(1, round(len(started) * tail_share))
    tail = sorted(range(len(started)), key=lambda index: started[index][1], reverse=True)[:num_tail]
    places = ", ".join(f"#{index + 1} at +{(started[index][0] - first_ns) / 1e9:.2f} s ({started[index][1]:.0f} ms)"
                       for index in sorted(tail))
    return f"slowest {num_tail} first tokens of {len(started)}: {places}"


def run_aiperf(args: argparse.Namespace, url: str, concurrency: int, seed: int, out_dir: Path) -> dict[str, float]:
    """One aiperf run on its own; the measures of its summary."""
    started_s = time.monotonic()
    return finish_aiperf(args, start_aiperf(args, url, concurrency, seed, out_dir), url, out_dir, started_s)


def run_together(args: argparse.Namespace, urls: dict[str, str], concurrency: int, seed: int,
                 out_dirs: dict[str, Path]) -> dict[str, dict[str, float]]:
    """One aiperf run per system, all at once: each system's measures. The systems share the machine's CPUs and the
    GPU while they run, so a drift in the machine's speed (an H200 guest's single-thread speed swings by a third
    from minute to minute: docs/performance.md) falls on all of them alike."""
    started_s = time.monotonic()
    processes = {name: start_aiperf(args, url, concurrency, seed, out_dirs[name]) for name, url in urls.items()}
    try:
        rows = {name: finish_aiperf(args, process, urls[name], out_dirs[name], started_s)
                for name, process in processes.items()}
    finally:
        for process in processes.values():  # one failed: the others' results no longer pair with it
            if process.poll() is None:
                process.kill()
    add_shared_window_rates(rows, {name: out_dirs[name] / "profile_export.jsonl" for name in urls})
    return rows


def generation_spans(records_path: Path) -> list[tuple[int, int, int]]:
    """(first token ns, end ns, output tokens) of each request of a run's profiling phase that succeeded."""
    spans = []
    for record in profiling_records(records_path):
        metadata, metrics = record["metadata"], record.get("metrics", {})
        if "time_to_first_token" not in metrics or "output_sequence_length" not in metrics:
            continue
        first_ns = int(metadata["request_start_ns"]) + int(float(metrics["time_to_first_token"]["value"]) * 1e6)
        spans.append((first_ns, int(metadata["request_end_ns"]), int(metrics["output_sequence_length"]["value"])))
    return spans


def tokens_in_window(spans: list[tuple[int, int, int]], start_ns: int, end_ns: int) -> float:
    """Output tokens generated between start_ns and end_ns, each request's spread evenly over its generation."""
    total = 0.0
    for first_ns, last_ns, num_tokens in spans:
        overlap_ns = min(last_ns, end_ns) - max(first_ns, start_ns)
        if last_ns > first_ns and overlap_ns > 0:
            total += num_tokens * overlap_ns / (last_ns - first_ns)
    return total


def add_shared_window_rates(rows: dict[str, dict[str, float]], records: dict[str, Path]) -> None:
    """Each system's token rate over only the time every system was generating ("tok/s shared"). aiperf takes tens of
    seconds to start, not always alike for each, so in a short run one system can stream alone for seconds at either
    end, with the machine to itself; its own rate then counts that time and the ratio leans its way."""
    if not all(path.exists() for path in records.values()):
        return
    spans = {name: generation_spans(path) for name, path in records.items()}
    if not all(spans.values()):
        return
    began_ns = {name: min(first for first, _, _ in runs) for name, runs in spans.items()}
    start_ns = max(began_ns.values())
    end_ns = min(max(last for _, last, _ in runs) for runs in spans.values())
    if end_ns <= start_ns:
        return
    offsets = ", ".join(f"{name} +{(began - min(began_ns.values())) / 1e9:.1f} s" for name, began in began_ns.items())
    say(f"  streaming began: {offsets}; all streamed together for {(end_ns - start_ns) / 1e9:.1f} s")
    for name, runs in spans.items():
        rows[name]["tok/s shared"] = tokens_in_window(runs, start_ns, end_ns) / ((end_ns - start_ns) / 1e9)


class Level(NamedTuple):
    """A level of the run: its streams, and which time it runs in this run (`--concurrency 16 256 16` runs 16 twice,
    to see what the levels between leave behind)."""

    concurrency: int
    pass_number: int = 1

    def __str__(self) -> str:
        return str(self.concurrency) if self.pass_number == 1 else f"{self.concurrency}#{self.pass_number}"

    def seed(self, seed_base: int, round_index: int) -> int:
        """Fresh prompts for each level, pass and round (rounds and passes are capped so that none collide)."""
        return seed_base + 1000 * self.concurrency + 100 * (self.pass_number - 1) + round_index

    def out_dir(self, out: Path) -> Path:
        name = f"c{self.concurrency}" if self.pass_number == 1 else f"c{self.concurrency}-pass{self.pass_number}"
        return out / name


MAX_ROUNDS = 99
MAX_PASSES = 10


def levels_of(concurrencies: list[int]) -> list[Level]:
    """Each level asked for, with how many times its streams ran before it in this run."""
    return [Level(concurrency, concurrencies[: index + 1].count(concurrency))
            for index, concurrency in enumerate(concurrencies)]


def round_ratios(mine: list[dict[str, float]], theirs: list[dict[str, float]], metric: str) -> list[float]:
    """`metric`'s ratio in each round, mine over theirs; empty where a round lacks it (one not run together)."""
    if not all(metric in row for row in mine + theirs):
        return []
    return [mine_row[metric] / max(their_row[metric], 1e-9) for mine_row, their_row in zip(mine, theirs)]


def mean_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each measure's mean over instances of one system in one round (the measures all of them have)."""
    return {key: statistics.fmean(row[key] for row in rows) for key in rows[0] if all(key in row for row in rows)}


def with_groups(rounds: dict[str, list[dict[str, float]]],
                groups: dict[str, list[str]]) -> dict[str, list[dict[str, float]]]:
    """The groups' rounds (each round the mean of its members'), in the order given, then every target's own."""
    grouped = {name: [mean_row(list(members_rows)) for members_rows in zip(*(rounds[member] for member in members))]
               for name, members in groups.items()}
    return {**grouped, **rounds}


def parse_group(text: str) -> tuple[str, list[str]]:
    name, separator, members = text.partition("=")
    names = [member for member in members.split(",") if member]
    if not separator or not name or len(names) < 2:
        raise argparse.ArgumentTypeError(f"a group is NAME=A,B (two targets or more), not {text!r}")
    return name, names


def print_level(level: Level, rounds: dict[str, list[dict[str, float]]]) -> None:
    names = list(rounds)
    reference = names[0]
    medians = {name: median_row(rows) for name, rows in rounds.items()}
    print(f"\nconcurrency {level}, {len(rounds[reference])} rounds (medians over rounds; ratio = system ÷ "
          f"{reference})")
    print(f"{'system':<10} | " + " | ".join(f"{key:>16}" for key in MEASURES))
    for name in names:
        cells = []
        for key in MEASURES:
            value = medians[name][key]
            ratio = "" if name == reference else f" {value / max(medians[reference][key], 1e-9):.2f}×"
            cells.append(f"{value:>9.1f}{ratio:>7}")
        print(f"{name:<10} | " + " | ".join(cells))
    def tok_ratios(name: str, other: str) -> list[float]:
        return round_ratios(rounds[name], rounds[other], "tok/s")

    for name in names[1:]:
        print(f"{name:<10} | tok/s ratio by round: {', '.join(f'{r:.2f}×' for r in tok_ratios(name, reference))}")
        if shared := round_ratios(rounds[name], rounds[reference], "tok/s shared"):
            print(f"{name:<10} | tok/s ratio by round, only while all streamed: "
                  f"{', '.join(f'{r:.2f}×' for r in shared)} (median {statistics.median(shared):.2f}×)")
    # Two settings of our own measured beside the server (stack a and stack b): their ratio to each other, round by
    # round, is what the comparison is about.
    for index, name in enumerate(names[1:], start=1):
        for other in names[index + 1:]:
            print(f"{name} ÷ {other} | tok/s by round: {', '.join(f'{r:.2f}' for r in tok_ratios(name, other))}")
    for name in names:
        tails = ", ".join(f"{row['ITL p99']:.1f} / {row['gap p99']:.1f} (TTFT {row['TTFT p50']:.0f})"
                          for row in rounds[name])
        print(f"{name:<10} | ITL p99 / gap p99 ms by round (TTFT p50 ms): {tails}")
    sys.stdout.flush()


def together_at(args: argparse.Namespace, concurrency: int) -> bool:
    """Whether a level's rounds run every system at once (--together, or --together-from at most this level)."""
    return args.together or (args.together_from is not None and concurrency >= args.together_from)


def print_goals(results: dict[Level, dict[str, list[dict[str, float]]]], num_systems: int | None = None) -> None:
    """Issue 11's goals, read off this run's medians over rounds: each system against the first (the reference); with
    `num_systems`, only the first that many (the groups, where there are). Each ratio also as the median of its
    round-by-round ratios, for reading only: a round of systems run together shares the machine's speed, which that
    median keeps and the ratio of medians does not."""
    reference, *others = list(next(iter(results.values())))[:num_systems]
    for name in others:
        print(f"\nissue 11's goals, {name} against {reference} (medians over rounds; in brackets the median of the "
              "rounds' own ratios, and of those over only the time all streamed where they ran together)")
        for level, rounds in results.items():
            by_round = {metric: statistics.median(ratios) for metric in ("tok/s", "ITL p99", "tok/s shared")
                        if (ratios := round_ratios(rounds[name], rounds[reference], metric))}
            for line in goal_lines(level.concurrency, median_row(rounds[name]), median_row(rounds[reference]),
                                   by_round):
                print(f"  c={str(level):<4} {line}")
    sys.stdout.flush()


def goal_ratio(ratio: float, goal: float) -> str:
    """A ratio to two places, or to three where two would read as the goal itself (0.969 against 0.97 is a miss)."""
    two_places = f"{ratio:.2f}"
    return f"{ratio:.3f}" if two_places == f"{goal:.2f}" and ratio != goal else two_places


class GoalCheck(NamedTuple):
    """One of issue 11's goals at one level: what it asks and this run's figure ("ITL p99 ≤ 1.05×: 0.93×")."""

    text: str
    met: bool

    def line(self) -> str:
        return f"{self.text} {'met' if self.met else 'NOT met'}"


def goal_checks(concurrency: int, mine: dict[str, float], reference: dict[str, float]) -> list[GoalCheck]:
    """Each goal that applies at this level, read off one system's row against the reference's."""
    tok_ratio = mine["tok/s"] / max(reference["tok/s"], 1e-9)
    itl_ratio = mine["ITL p99"] / max(reference["ITL p99"], 1e-9)
    checks = [GoalCheck(f"output tok/s ≥ 0.97×: {goal_ratio(tok_ratio, 0.97)}×", tok_ratio >= 0.97),
              GoalCheck(f"ITL p99 ≤ 1.05×: {goal_ratio(itl_ratio, 1.05)}×", itl_ratio <= 1.05)]
    if concurrency == 1:
        added_ms = mine["TTFT p50"] - reference["TTFT p50"]
        checks.append(GoalCheck(f"TTFT p50 added ≤ 3 ms: {added_ms:+.1f} ms", added_ms <= 3.0))
    if concurrency == 64:
        ttft_ratio = mine["TTFT p99"] / max(reference["TTFT p99"], 1e-9)
        checks.append(GoalCheck(f"TTFT p99 ≤ 1.2×: {goal_ratio(ttft_ratio, 1.2)}×", ttft_ratio <= 1.2))
    return checks


def goal_lines(concurrency: int, mine: dict[str, float], reference: dict[str, float],
               by_round: dict[str, float]) -> list[str]:
    """One line per goal that applies at this level, each with its figure, whether it is met, and (for the token rate
    and ITL) the median of the rounds' own ratios in brackets."""
    tok_check, itl_check, *first_token_checks = goal_checks(concurrency, mine, reference)
    # A level run together also has each round's rate over only the time every system streamed.
    shared = f"; while all streamed {by_round['tok/s shared']:.2f}×" if "tok/s shared" in by_round else ""
    return [f"{tok_check.line()} ({by_round['tok/s']:.2f}×{shared})",
            f"{itl_check.line()} ({by_round['ITL p99']:.2f}×)",
            *(check.line() for check in first_token_checks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", type=parse_target,
                        help="NAME=URL of each server (OpenAI API root, no /v1); the first is the reference")
    parser.add_argument("--tokenizer", required=True,
                        help="a local tokenizer folder (e.g. .gpu/smol); aiperf loads it offline, from a Hugging Face "
                             "cache laid out under --out (hf-cache/)")
    parser.add_argument("--model-name", default=None,
                        help="the model name both servers answer to (default: the tokenizer folder's path)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64],
                        help="levels of streams, in order; a level named again runs again with fresh prompts and is "
                             "reported on its own as N#2 (e.g. 16 256 16: what the heavier level leaves behind)")
    parser.add_argument("--rounds", type=int, default=4,
                        help=f"rounds per level (at most {MAX_ROUNDS}); even, so that each order runs as often as its "
                             "reverse")
    parser.add_argument("--rounds-at", type=parse_level_number, action="append", default=[], metavar="STREAMS=N",
                        help="rounds at one level, e.g. 16=5 (repeat for more levels): more rounds where the systems' "
                             "ratio is close to a goal and a round's spread is several percent")
    parser.add_argument("--requests-per-stream", type=int, default=4,
                        help="requests per concurrent stream in a run (default 4)")
    parser.add_argument("--requests-per-stream-at", type=parse_level_number, action="append", default=[],
                        metavar="STREAMS=N",
                        help="requests per stream at one level, e.g. 16=24 (repeat for more levels): at 4-6 a stream, "
                             "a 16-stream run is about 6 s under load, where one long straggler moves its rate by "
                             "several percent")
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="runs per system before the first level's rounds, not counted, of one request a stream "
                             "(at least --min-requests): a fresh SGLang compiles for new batch shapes in its first run "
                             "(default 1)")
    parser.add_argument("--workers-max", type=int, default=None,
                        help="aiperf's worker processes (its default: up to 3/4 of the CPUs, at most 32; each "
                             "takes seconds to start)")
    parser.add_argument("--seed-base", type=int, default=None,
                        help="repeat a run's prompts (default: drawn afresh, and printed)")
    parser.add_argument("--run-timeout-s", type=float, default=600.0)
    parser.add_argument("--together", action="store_true",
                        help="run every system's aiperf at the same time in each round, with the same prompts: "
                             "the systems share the machine, and its drift in speed between rounds cancels out of "
                             "each round's ratio (default: one system after another)")
    parser.add_argument("--together-from", type=int, default=None, metavar="STREAMS",
                        help="run together only the levels of at least STREAMS streams, and the rest one system "
                             "after another: at one stream two engines on one GPU step at the rate they share, which "
                             "hides an engine's own rate (e.g. --concurrency 256 64 16 1 --together-from 16)")
    parser.add_argument("--group", type=parse_group, action="append", default=[], metavar="NAME=A,B",
                        help="a system measured as the mean of several targets, each round (repeat for each system; "
                             "the first group is the reference, and the goals are read off the groups)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-aiperf"))
    args = parser.parse_args()
    args.requests_per_stream_at = dict(args.requests_per_stream_at)
    if args.together and args.together_from is not None:
        parser.error("--together runs every level together; --together-from picks the levels: give one of them")
    args.model_name = args.model_name or args.tokenizer
    levels = levels_of(args.concurrency)
    args.rounds_at = dict(args.rounds_at)
    if not all(1 <= rounds <= MAX_ROUNDS for rounds in [args.rounds, *args.rounds_at.values()]):
        parser.error(f"--rounds and each --rounds-at must be 1 to {MAX_ROUNDS} "
                     "(each round's prompts have a seed of their own)")
    if max(level.pass_number for level in levels) > MAX_PASSES:
        parser.error(f"a level may run at most {MAX_PASSES} times in one run")
    target_names = {name for name, _ in args.targets}
    if len(target_names) != len(args.targets):
        parser.error("target names must differ")
    groups = dict(args.group)
    grouped = [member for members in groups.values() for member in members]
    if len(groups) != len(args.group) or set(groups) & target_names:
        parser.error("group names must differ from each other and from the targets'")
    if not set(grouped) <= target_names or len(set(grouped)) != len(grouped):
        parser.error("a group's members are targets, each in one group at most")
    if len(groups) == 1:
        parser.error("groups are compared with each other: give two or more")
    seed_base = args.seed_base if args.seed_base is not None else random.randrange(1_000_000)
    say(f"seed base {seed_base} (--seed-base {seed_base} repeats these prompts)")

    urls = dict(args.targets)
    args.hf_cache = offline_tokenizer_cache(Path(args.tokenizer), args.out / "hf-cache")
    args.aiperf_site = aiperf_site(args.out / "aiperf-site")
    # Warm-up prompts get seeds below every level's (Level.seed: seed_base + 1000 * concurrency + ...), so no counted
    # run finds them cached.
    # A warm-up run is one request a stream: every batch size up to the level's is stepped through as the streams
    # ramp up and drain, which is what the engines compile for, and it costs a lease ~40 s less at 256 streams.
    warmup_args = argparse.Namespace(**{**vars(args), "requests_per_stream": 1, "requests_per_stream_at": {}})
    for warmup_index in range(args.warmup_runs):
        seed = seed_base + 999 - warmup_index
        out_dirs = {name: args.out / "warmup" / f"{name}-{warmup_index}" for name in urls}
        if together_at(args, args.concurrency[0]):  # as the first level runs: a profiler then opens on all at once
            say(f"warm-up {warmup_index + 1}/{args.warmup_runs} at concurrency {args.concurrency[0]}: together")
            run_together(warmup_args, urls, args.concurrency[0], seed, out_dirs)
            continue
        for name, url in urls.items():
            say(f"warm-up {warmup_index + 1}/{args.warmup_runs} at concurrency {args.concurrency[0]}: {name}")
            run_aiperf(warmup_args, url, args.concurrency[0], seed, out_dirs[name])
    results: dict[Level, dict[str, list[dict[str, float]]]] = {}
    for level in levels:
        concurrency = level.concurrency
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        num_rounds = args.rounds_at.get(concurrency, args.rounds)
        for round_index in range(num_rounds):
            seed = level.seed(seed_base, round_index)
            out_dirs = {name: level.out_dir(args.out) / f"r{round_index}" / name for name in urls}
            if together_at(args, concurrency):
                say(f"concurrency {level}, round {round_index + 1}/{num_rounds}: {', '.join(urls)} together")
                rows = run_together(args, urls, concurrency, seed, out_dirs)
            else:
                rows = {}
                for name in round_order(list(urls), round_index):
                    say(f"concurrency {level}, round {round_index + 1}/{num_rounds}: {name}")
                    rows[name] = run_aiperf(args, urls[name], concurrency, seed, out_dirs[name])
            for name, row in rows.items():
                rounds[name].append(row)
                say(f"  {name}: " + ", ".join(f"{key} {value:.1f}" for key, value in row.items()))
        results[level] = with_groups(rounds, groups)
        print_level(level, results[level])
        # Written after every level, so that a run cut off by a time limit keeps the levels it finished.
        (args.out / "results.json").write_text(json.dumps(
            {"seed_base": seed_base, "levels": {str(done): rows for done, rows in results.items()}}, indent=1))
    print_goals(results, len(groups) or None)


if __name__ == "__main__":
    main()
