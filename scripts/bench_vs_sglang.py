"""SGLang's own HTTP server versus Conveyor serving SGLang, both driven by the same third-party client.

On a GPU machine (docs/gpu.md has the procedure), one run starts, side by side on the one GPU:
- **sglang**: `python -m sglang.launch_server` (its own tokenizer, scheduler and detokenizer processes);
- **conveyor**: a nats-server, a processor, a decode worker with the SGLang engine and the OpenAI gateway,
  each its own process, as a deployment runs them.
Then, for each concurrency and each round (the order of the two alternates between rounds), it runs
`python -m sglang.bench_serving --backend sglang-oai` (SGLang's own load client, in its own process) against
each server's `/v1/completions` with random-token prompts, and — unless `--nats-clients 0` — the same load
published straight to NATS by `--nats-clients` client processes (the bus without the gateway). It prints the
median round of each and the ratios conveyor ÷ sglang; `--profile-concurrency` also records each Conveyor
process with py-spy (when it is on the PATH) during one more run at that concurrency. Results and profiles go
to $OUT (or --out).

    bash scripts/gpu_run.sh python3 scripts/bench_vs_sglang.py --model .gpu/smol --concurrency 1 16 64 128 256

`nats-client` (a NATS client process), `bench-once` (the profiled load) and `serving-loop` (bench_serving kept
running between runs, `--persistent-client`) are modes the benchmark runs itself in. `conveyor` starts the Conveyor
stack alone and keeps it until stopped, so that several device calls measure one warm stack (`--conveyor-url`),
as `--sglang-url` does for a server started by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import random
import shutil
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
import uuid
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# prometheus_client and the project's packages are imported where they are used: the GPU machine's reports
# (goals_noise.py, through bench_aiperf) import this module with only the standard library to hand.


def say(message: str) -> None:
    print(f"[bench-vs-sglang {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def wait_http(url: str, what: str, timeout_s: float, processes: list[subprocess.Popen[bytes]],
              ready: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{what}: a process exited with {process.returncode} before it was ready")
        if http_ok(url) and (ready is None or ready()):
            say(f"{what} ready after {time.monotonic() - started:.0f} s")
            return
        time.sleep(1.0)
    raise RuntimeError(f"{what} not ready within {timeout_s:.0f} s")


def model_listed(base_url: str, model: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=5) as response:
            return any(entry["id"] == model for entry in json.load(response)["data"])
    except (OSError, KeyError, ValueError):
        return False


class Servers:
    """The two systems under test and the processes behind them (stopped together)."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.args, self.logs = args, logs
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.nats_url = ""
        self.namespace = f"vs{uuid.uuid4().hex[:6]}"

    def spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 — kept open for the child's life
        # A session of its own: Ctrl-C on the benchmark does not reach every child at once; stop() orders them.
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def start_sglang(self) -> str:
        args = self.args
        url = f"http://127.0.0.1:{args.sglang_port}"
        self.spawn("sglang", [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
                              "--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                              "--mem-fraction-static", str(args.sglang_mem_fraction), "--host", "127.0.0.1",
                              "--page-size", str(args.page_size), *running_limit(args), *server_kv_events(args),
                              "--port", str(args.sglang_port), "--log-level", "warning"])
        wait_http(f"{url}/v1/models", "sglang server", args.start_timeout_s, [self.processes["sglang"]],
                  ready=lambda: model_listed(url, args.model))
        return url

    def start_conveyor(self) -> str:
        args = self.args
        port = args.nats_port
        self.nats_url = f"nats://127.0.0.1:{port}"
        store = self.logs / "nats-store"
        store.mkdir(exist_ok=True)
        # Monitoring 4000 above the client port (8222 for 4222): a second stack's server must not collide.
        self.spawn("nats", [sys.executable, "-m", "workers.cli", "server", "--port", str(port), "--store-dir", str(store),
                            "--monitor-port", str(port + 4000)])
        env = {"CONVEYOR_NATS_URLS": self.nats_url, "CONVEYOR_NAMESPACE": self.namespace}
        worker = [sys.executable, "-m", "workers.cli", "worker", "--engine", args.engine, "--model", args.model,
                  "--load-format", "dummy", "--log-level", "WARNING", "--max-concurrency", str(args.worker_concurrency)]
        self.spawn("processor", worker[:4] + ["processor"] + worker[4:] + ["--http-port", str(METRICS_PORTS["processor"])], env)
        # SGLang sizes its KV pool from the memory free at its start: the server above already holds its share.
        self.spawn("decode", worker[:4] + ["decode"] + worker[4:] + ["--http-port", str(METRICS_PORTS["decode"]),
                                                                     *shlex.split(args.decode_args)],
                   {**env, "CONVEYOR_SGLANG_MEM_FRACTION_STATIC": str(args.conveyor_mem_fraction),
                    "CONVEYOR_SGLANG_PAGE_SIZE": str(args.page_size),
                    "CONVEYOR_SGLANG_EXTRA_SERVER_ARGS": json.dumps(extra_server_args(args))})
        url = f"http://127.0.0.1:{args.gateway_port}"
        self.spawn("gateway", [sys.executable, "-m", "workers.cli", "gateway", "--port", str(args.gateway_port),
                               "--host", "127.0.0.1", "--log-level", "WARNING", "--workers", str(args.gateway_workers)],
                   env)
        wait_http(f"{url}/v1/models", "conveyor (gateway, processor, decode)", args.start_timeout_s,
                  list(self.processes.values()), ready=lambda: model_listed(url, args.model))
        return url

    def pid(self, name: str) -> int:
        """A Conveyor process's pid: one this run started, else (`--conveyor-url`) the one whose command line
        runs that stage (`conveyor` mode started it)."""
        if name in self.processes:
            return self.processes[name].pid
        words = ["workers.cli", "gateway"] if name == "gateway" else ["workers.cli", "worker", name]
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if entry.name.isdigit() and all(word in argv for word in words):
                return int(entry.name)
        raise RuntimeError(f"no running Conveyor {name} process found")

    def stop(self) -> None:
        """Clients of the bus first (gateway, processor, decode), the nats-server once they are gone."""
        from workers.launcher import stop_processes

        order = [name for name in reversed(self.processes) if name != "nats"] + ["nats"] * ("nats" in self.processes)
        for name in order:
            asyncio.run(stop_processes([self.processes[name]], grace_s=30))


def num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.min_prompts, concurrency * args.prompts_per_stream)


def bench_http(args: argparse.Namespace, client: ServingClient, base_url: str, concurrency: int, seed: int,
               out: Path) -> dict[str, Any]:
    """One sglang.bench_serving run; its JSON line."""
    out.unlink(missing_ok=True)
    client.run(["--backend", "sglang-oai", "--base-url", base_url,
                "--model", args.model, "--tokenizer", args.model, "--dataset-name", "random-ids",
                "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(num_prompts(args, concurrency)),
                "--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm", "--output-file", str(out)],
               args.run_timeout_s)
    if not out.exists():
        raise RuntimeError(f"bench_serving wrote no results to {out}")
    row = json.loads(out.read_text().strip().splitlines()[-1])
    return {key: row[key] for key in ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                      "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms") if key in row}


_RUN_DONE = "@@bench-serving-run-done"


class ServingClient:
    """SGLang's bench_serving, kept running between runs (`serving-loop` mode: imported once, one run per line of
    arguments on its stdin). A run as its own `python -m sglang.bench_serving` spends ~25 s on the GPU machine
    importing and loading before its first request, most of a device call over a benchmark's dozen runs. Where the
    loop cannot run (it died, or this SGLang has no `cli_main`), each run is its own process again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._persistent = args.persistent_client
        self._process: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=40)

    def run(self, arguments: list[str], timeout_s: float) -> None:
        if self._persistent:
            try:
                return self._run_in_loop(arguments, timeout_s)
            except _LoopGone as error:
                say(f"bench_serving loop unavailable ({error}); one process per run from here")
                self._persistent = False
                self.close()
        completed = subprocess.run([sys.executable, "-m", "sglang.bench_serving", *arguments], check=False, cwd=ROOT,
                                   capture_output=True, text=True, timeout=timeout_s)
        if completed.returncode != 0:
            raise RuntimeError(f"bench_serving failed ({completed.returncode}): {completed.stderr[-2000:]}")

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process = None

    def _run_in_loop(self, arguments: list[str], timeout_s: float) -> None:
        process = self._started()
        assert process.stdin is not None
        try:
            process.stdin.write(json.dumps(arguments) + "\n")
            process.stdin.flush()
        except BrokenPipeError as error:
            raise _LoopGone("its process exited") from error
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline_s - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError(f"bench_serving run took over {timeout_s:.0f} s") from None
            if line is None:
                raise _LoopGone(f"its process exited: {' | '.join(self._tail)[-1500:]}")
            if line.startswith(_RUN_DONE):
                code = line.split()[1]
                if code == "unavailable":
                    raise _LoopGone("this SGLang has no bench_serving cli_main")
                if code != "0":
                    raise RuntimeError(f"bench_serving failed ({code}): {' | '.join(self._tail)[-2000:]}")
                return
            self._tail.append(line.rstrip())

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None:
            self._process = subprocess.Popen(
                [sys.executable, __file__, "serving-loop", "--model", self._args.model], cwd=ROOT, text=True,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            threading.Thread(target=self._read, args=(self._process,), daemon=True).start()
        return self._process

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._lines.put(line)
        self._lines.put(None)


class _LoopGone(Exception):
    """The bench_serving loop cannot take runs."""


def serving_loop() -> None:
    """`serving-loop` mode: SGLang's bench_serving imported once; each line on stdin is one run's arguments (JSON),
    each run ends with a `_RUN_DONE <exit code>` line on stdout, after whatever bench_serving printed."""
    try:
        from sglang.benchmark.serving import cli_main
    except ImportError:
        try:
            from sglang.bench_serving import cli_main
        except ImportError:
            cli_main = None
    for line in sys.stdin:
        if cli_main is None:
            print(f"{_RUN_DONE} unavailable", flush=True)
            continue
        sys.argv = ["bench_serving", *json.loads(line)]
        try:
            cli_main()
            code: int | str = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # a failed run is reported, and the loop takes the next
            traceback.print_exc(file=sys.stdout)
            code = 1
        print(f"\n{_RUN_DONE} {code}", flush=True)


def bench_nats(args: argparse.Namespace, nats_url: str, namespace: str, concurrency: int, seed: int) -> dict[str, Any]:
    """The same load published to NATS by `--nats-clients` processes; their samples merged."""
    clients = min(args.nats_clients, concurrency)
    total = num_prompts(args, concurrency)
    commands = []
    for k in range(clients):
        share = concurrency // clients + (1 if k < concurrency % clients else 0)
        prompts = total // clients + (1 if k < total % clients else 0)
        commands.append([sys.executable, __file__, "nats-client", "--nats", nats_url, "--namespace", namespace,
                         "--model", args.model, "--concurrency", str(share), "--num-prompts", str(prompts),
                         "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                         "--range-ratio", str(args.range_ratio), "--seed", str(seed * 1000 + k)])
    started = time.perf_counter()
    children = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) for command in commands]
    # The last line is the samples (structlog may have written to stdout before it).
    samples = [json.loads(child.communicate(timeout=args.run_timeout_s)[0].strip().splitlines()[-1]) for child in children]
    # Wall time of the whole load: from the first client's start to the last one's end.
    duration_s = max(s["end"] for s in samples) - min(s["start"] for s in samples) or time.perf_counter() - started
    ttfts = sorted(t for s in samples for t in s["ttft_ms"])
    itls = sorted(t for s in samples for t in s["itl_ms"])
    return {"completed": len(ttfts), "output_throughput": sum(s["tokens"] for s in samples) / duration_s,
            "median_ttft_ms": statistics.median(ttfts), "p99_ttft_ms": percentile(ttfts, 99),
            "median_itl_ms": statistics.median(itls) if itls else 0.0, "p99_itl_ms": percentile(itls, 99),
            "errors": sum(s["errors"] for s in samples)}


def extra_server_args(args: argparse.Namespace) -> dict[str, Any]:
    """Conveyor's SGLang settings beyond its defaults: the caller's CONVEYOR_SGLANG_EXTRA_SERVER_ARGS (e.g. KV events
    off), with the running-request limit added, never in place of them."""
    extra = json.loads(os.environ.get("CONVEYOR_SGLANG_EXTRA_SERVER_ARGS") or "{}")
    if args.max_running_requests:
        extra["max_running_requests"] = args.max_running_requests
    return extra


def server_kv_events(args: argparse.Namespace) -> list[str]:
    """SGLang's KV events on the reference server, published as Conveyor's engine has them published (ZMQ PUB bound
    on every interface; nobody need subscribe), when asked: Conveyor records them by default, the server does not."""
    if not args.sglang_kv_events:
        return []
    config = {"publisher": "zmq", "endpoint": f"tcp://*:{args.sglang_kv_events_port}", "topic": "kv-events"}
    return ["--kv-events-config", json.dumps(config)]


def running_limit(args: argparse.Namespace) -> list[str]:
    """SGLang's running-request limit, the same for both engines when asked: at one limit they run the same batch
    sizes, so their inter-token latencies compare steps of equal size."""
    return ["--max-running-requests", str(args.max_running_requests)] if args.max_running_requests else []


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def nats_client(args: argparse.Namespace) -> None:
    """Mode of one client process: `concurrency` streams over `num_prompts` requests, samples as JSON on stdout."""
    from bus.client import open_client
    from bus.settings import BusSettings, NatsSettings
    from schemas.client import CompletionRequest, StreamFormat
    from schemas.replies import FinalFrame, FinishReason

    rng = random.Random(args.seed)
    low_in, low_out = int(args.input_len * args.range_ratio), int(args.output_len * args.range_ratio)
    work = [([rng.randrange(1000, 30000) for _ in range(rng.randint(low_in, args.input_len))],
             rng.randint(low_out, args.output_len)) for _ in range(args.num_prompts)]
    samples: dict[str, Any] = {"ttft_ms": [], "itl_ms": [], "tokens": 0, "errors": 0}
    async with open_client(NatsSettings(urls=[args.nats]), BusSettings(namespace=args.namespace), "bench-nats") as client:
        async def one(prompt: list[int], new_tokens: int) -> None:
            request = CompletionRequest(request_id=f"nats-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(),
                                        model=args.model, prompt=prompt, max_tokens=new_tokens, ignore_eos=True,
                                        temperature=0.0, stream_format=StreamFormat.TOKENS)
            sent = last = time.perf_counter()
            first = True
            async with await client.submit(request, first_frame_timeout_s=300) as stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    (samples["ttft_ms"] if first else samples["itl_ms"]).append(1000 * (now - (sent if first else last)))
                    first, last = False, now
                    samples["tokens"] += len(chunk.token_ids)
            if not isinstance(stream.terminal, FinalFrame) or stream.terminal.finish_reason != FinishReason.LENGTH:
                samples["errors"] += 1

        queue = list(work)

        async def stream_worker() -> None:
            while queue:
                await one(*queue.pop())

        samples["start"] = time.time()
        await asyncio.gather(*(stream_worker() for _ in range(args.concurrency)))
        samples["end"] = time.time()
    print(json.dumps(samples))


METRICS_PORTS = {"processor": 9101, "decode": 9102}
# The decode worker's view of a loaded run: tasks it holds, and the engine's running and waiting requests.
PROBED = ("conveyor_in_flight{stage=\"decode\"}", "conveyor_engine_running_requests", "conveyor_engine_waiting_requests")


def metrics_text(name: str) -> str:
    """A worker's /metrics page ("" when it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORTS[name]}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return ""


def scrape(name: str) -> dict[str, float]:
    """A worker's /metrics as {series: value} (histogram buckets left out)."""
    values = {}
    for line in metrics_text(name).splitlines():
        if line and not line.startswith("#") and "_bucket{" not in line:
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def itl_buckets() -> dict[float, float]:
    """The decode worker's inter-token histogram, {upper bound s: cumulative count}: the gaps as the worker saw them
    leave the engine, before the bus and the gateway."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text("decode")):
        if family.name == "conveyor_inter_token_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile (ms) of the observations between two scrapes, interpolated within its bucket."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    if not counts or counts[-1][1] <= 0:
        return None
    rank = q * counts[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound * 1000
            return (lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-9)) * 1000
        lower_bound, lower_count = bound, count
    return None


def probe(name: str) -> dict[str, float]:
    values = scrape(name)
    return {key: value for key, value in values.items() if key.startswith(PROBED)}


def queue_seconds(values: dict[str, float]) -> dict[str, float]:
    """Mean seconds a task waited in each stage's work stream, and mean handler seconds."""
    out = {}
    for metric in ("conveyor_queue_seconds", "conveyor_handler_seconds"):
        for key, total in values.items():
            if key.startswith(metric + "_sum"):
                count = values.get(key.replace("_sum", "_count"), 0)
                out[key.replace("_sum", "_mean")] = total / count if count else 0.0
    return out


def profile(args: argparse.Namespace, servers: Servers, conveyor_url: str, out_dir: Path) -> dict[str, Any]:
    """One more loaded run at --profile-concurrency: once its load reaches the decode worker, py-spy records every
    Conveyor process (and SGLang's scheduler under decode) while the decode worker's in-flight tasks and the
    engine's running / waiting requests are sampled every 0.5 s."""
    result: dict[str, Any] = {}
    loader = subprocess.Popen([sys.executable, __file__, "bench-once", "--model", args.model, "--base-url", conveyor_url,
                               "--concurrency", str(args.profile_concurrency), "--input-len", str(args.input_len),
                               "--output-len", str(args.output_len), "--range-ratio", str(args.range_ratio),
                               "--prompts-per-stream", str(args.prompts_per_stream * 3), "--min-prompts", "8",
                               "--run-timeout-s", str(args.run_timeout_s), "--out", str(out_dir)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    # Past bench_serving's start and its one warm-up request: half the streams are in the decode worker.
    deadline, loaded = time.monotonic() + 120, max(2, args.profile_concurrency // 2)
    while probe("decode").get('conveyor_in_flight{stage="decode"}', 0) < loaded and time.monotonic() < deadline:
        time.sleep(0.2)
    py_spy = shutil.which("py-spy")
    recorders = {}
    if py_spy is None:
        result["py_spy"] = "not on the PATH"
    else:
        recorders = {name: subprocess.Popen([py_spy, "record", "--nonblocking", "--pid", str(servers.pid(name)),
                                             "--duration", str(args.profile_s), "--rate", "100", "--format", "raw",
                                             "--output", str(out_dir / f"profile-{name}.txt")]
                                            + (["--subprocesses"] if name == "decode" else []),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for name in ("gateway", "processor", "decode")}
    samples = []
    while loader.poll() is None:
        samples.append(probe("decode"))
        time.sleep(0.5)
    result["load"] = json.loads(loader.communicate()[0].strip().splitlines()[-1])
    result["decode_samples"] = samples
    result["means"] = {name: queue_seconds(scrape(name)) for name in METRICS_PORTS}
    for name, recorder in recorders.items():
        try:
            _, stderr = recorder.communicate(timeout=args.profile_s + 30)
            result[f"py_spy_{name}"] = "ok" if recorder.returncode == 0 else stderr[-500:]
        except subprocess.TimeoutExpired:
            recorder.kill()
            result[f"py_spy_{name}"] = "timed out"
    return result


CONTROL = "sglang-control"
# Past any round index: a control run never shares a seed, and so a prompt, with another run of its level.
CONTROL_SEED_OFFSET = 50_000


def round_order(systems: list[str], round_index: int) -> list[str]:
    """Each pair of rounds runs one order and then its reverse, so every system runs before and after each other
    system equally often. A plain rotation does not: with three systems B follows A in every round, so comparing A
    with B cannot tell their settings from their order (docs/performance.md, twenty-third stop). The order the pairs
    start from rotates, so over 2·N rounds each system also runs first, last and in between."""
    shift = (round_index // 2) % len(systems)
    order = systems[shift:] + systems[:shift]
    return order[::-1] if round_index % 2 else order


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each measure's median over the rounds (a tail latency is not taken from the round of the median tok/s)."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]
            if all(isinstance(row.get(key), (int, float)) for row in rows)}


def tail_by_round(rows: list[dict[str, Any]]) -> str:
    """Each round's ITL p99 beside its TTFT p50. The inter-token tail flips between regimes from one round to the
    next, with the first token (docs/performance.md, tenth stop): a median of a few rounds is not the whole story."""
    return ", ".join(f"{row.get('p99_itl_ms', 0):.1f} (TTFT {row['median_ttft_ms']:.0f})" for row in rows)


def print_table(report: dict[str, Any]) -> None:
    """Each system's median round, its ratios to the server's, and the tok/s ratio of each round (the two
    systems of one round ran back to back, so a round's ratio is the least noisy figure)."""
    systems = [s for s in ("sglang", CONTROL, "conveyor", "conveyor-nats") if s in next(iter(report["levels"].values()))]
    print("\nconc | system         |  tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "vs sglang: tok/s, TTFT p50, TTFT p99, ITL p50, ITL p99 | tok/s ratio by round")
    for level, by_system in report["levels"].items():
        base = by_system["sglang"]
        for system in systems:
            row = by_system[system]
            ratio = by_round = ""
            if system != "sglang":
                ratio = ", ".join(f"{row.get(key, 0) / max(base.get(key, 0), 1e-9):.2f}×" for key in (
                    "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms"))
                rounds = by_system.get("rounds", {})
                by_round = ", ".join(f"{mine['output_throughput'] / theirs['output_throughput']:.2f}×"
                                     for mine, theirs in zip(rounds.get(system, []), rounds.get("sglang", [])))
            print(f"{level:>4} | {system:<14} | {row['output_throughput']:>6.0f} | {row['median_ttft_ms']:>7.1f} / "
                  f"{row['p99_ttft_ms']:>7.1f} | {row['median_itl_ms']:>6.2f} / {row.get('p99_itl_ms', 0):>6.2f} | "
                  f"{ratio} | {by_round}")
        rounds = by_system.get("rounds", {})
        if rounds.get("conveyor") and rounds.get("sglang"):
            added = [mine["median_ttft_ms"] - theirs["median_ttft_ms"]
                     for mine, theirs in zip(rounds["conveyor"], rounds["sglang"])]
            print(f"{level:>4} | TTFT p50 added by Conveyor, median over rounds of each round's difference: "
                  f"{statistics.median(added):+.1f} ms (rounds: {', '.join(f'{value:+.1f}' for value in added)})")
        if rounds.get("conveyor") and rounds.get("sglang"):
            control = f"; {CONTROL} {tail_by_round(rounds[CONTROL])}" if rounds.get(CONTROL) else ""
            print(f"{level:>4} | ITL p99 ms by round (TTFT p50 ms): sglang {tail_by_round(rounds['sglang'])}; "
                  f"conveyor {tail_by_round(rounds['conveyor'])}{control}")
        if "decode_p99_itl_ms" in by_system.get("conveyor", {}):
            print(f"{level:>4} | ITL p99 as the decode worker saw tokens leave the engine (before the bus): "
                  f"{by_system['conveyor']['decode_p99_itl_ms']:.2f} ms")
    print(flush=True)


def warm_up(args: argparse.Namespace, client: ServingClient, urls: dict[str, str], logs: Path) -> None:
    """One discarded run per server at the highest concurrency, one prompt per stream: kernels compiled and memory
    pools grown for every batch size the levels reach, so the first level measured is not the one paying for it."""
    level = max(args.concurrency)
    for system, url in urls.items():
        if system == CONTROL:
            continue  # the server, warmed up already
        warm = argparse.Namespace(**{**vars(args), "prompts_per_stream": 1, "min_prompts": 1})
        row = bench_http(warm, client, url, level, seed=7, out=logs / f"{system}-warmup.jsonl")
        say(f"warm-up c={level} {system} (discarded): {row['output_throughput']:.0f} tok/s")


def interrupt(signum: int, frame: Any) -> None:
    # Once: a second SIGTERM (e.g. `timeout` and `pkill` both sending one) must not cut the orderly stop short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def compare_event_loops(args: argparse.Namespace) -> None:
    """`--event-loops`: no SGLang, no HTTP; the Conveyor stack (any engine, e.g. mock on a laptop) under the NATS
    clients once per event loop (CONVEYOR_EVENT_LOOP), loops alternating within each round; medians and ratios."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        loops = args.event_loops if round_index % 2 == 0 else list(reversed(args.event_loops))
        for loop in loops:
            logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-loops-{uuid.uuid4().hex[:6]}"
            logs.mkdir(parents=True)
            os.environ["CONVEYOR_EVENT_LOOP"] = loop
            servers = Servers(args, logs)
            try:
                servers.start_conveyor()
                row = bench_nats(args, servers.nats_url, servers.namespace, args.concurrency[0], round_index)
            finally:
                servers.stop()
            runs.setdefault(loop, []).append(row)
            say(f"round {round_index + 1} {loop}: {row['output_throughput']:.0f} tok/s, "
                f"TTFT p50 {row['median_ttft_ms']:.1f} ms, ITL p50 {row['median_itl_ms']:.2f} ms")
    base = median_row(runs[args.event_loops[0]])
    for loop, rows in runs.items():
        row = median_row(rows)
        print(f"{loop:>8}: {row['output_throughput']:>7.0f} tok/s ({row['output_throughput'] / base['output_throughput']:.2f}×), "
              f"TTFT p50 {row['median_ttft_ms']:.1f} ms, ITL p50 {row['median_itl_ms']:.2f} ms")


def run(args: argparse.Namespace) -> None:
    # A timeout's SIGTERM unwinds like Ctrl-C, so the results so far are written and the servers stopped.
    signal.signal(signal.SIGTERM, interrupt)
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / ".bench-vs-sglang")
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-vs-sglang-{uuid.uuid4().hex[:6]}"
    logs.mkdir(parents=True)
    servers = Servers(args, logs)
    client = ServingClient(args)
    report: dict[str, Any] = {"args": vars(args), "levels": {}}
    say(f"prompt seeds from {args.seed_base} (--seed-base {args.seed_base} repeats this run's prompts)")
    started = time.monotonic()
    try:
        urls = {"sglang": args.sglang_url or servers.start_sglang()}
        urls["conveyor"] = args.conveyor_url or servers.start_conveyor()
        if args.control:
            urls[CONTROL] = urls["sglang"]
        report["start_s"] = round(time.monotonic() - started, 1)
        if args.warmup:
            warm_up(args, client, urls, logs)
        for level in args.concurrency:
            runs: dict[str, list[dict[str, Any]]] = {}
            for round_index in range(args.rounds):
                order = round_order(list(urls), round_index)
                seed = args.seed_base + 100 * level + round_index
                for system in order:
                    before = itl_buckets() if system == "conveyor" else {}
                    # The control's prompts are its own: the server it measures again has the round's prompts cached.
                    own_seed = seed + CONTROL_SEED_OFFSET if system == CONTROL else seed
                    row = bench_http(args, client, urls[system], level, own_seed, logs / f"{system}.jsonl")
                    if before and (worker_p99 := bucket_quantile(before, itl_buckets(), 0.99)) is not None:
                        row["decode_p99_itl_ms"] = worker_p99
                    runs.setdefault(system, []).append(row)
                    worker = f" (decode worker's own {row['decode_p99_itl_ms']:.1f})" if "decode_p99_itl_ms" in row else ""
                    say(f"c={level} round {round_index + 1} {system}: {row['output_throughput']:.0f} tok/s, "
                        f"TTFT p50 {row['median_ttft_ms']:.1f} ms, ITL p50 {row['median_itl_ms']:.2f} ms, "
                        f"ITL p99 {row.get('p99_itl_ms', 0):.1f} ms{worker}")
                if args.nats_clients and not args.conveyor_url:
                    row = bench_nats(args, servers.nats_url, servers.namespace, level, seed)
                    runs.setdefault("conveyor-nats", []).append(row)
                    say(f"c={level} round {round_index + 1} conveyor-nats: {row['output_throughput']:.0f} tok/s, "
                        f"TTFT p50 {row['median_ttft_ms']:.1f} ms, errors {row['errors']}")
            report["levels"][level] = {system: median_row(rows) for system, rows in runs.items()}
            report["levels"][level]["rounds"] = runs
            (out_dir / "bench-vs-sglang.json").write_text(json.dumps(report, indent=1))
            if level == args.profile_concurrency:
                report["profile"] = profile(args, servers, urls["conveyor"], out_dir)
                summary = {key: value for key, value in report["profile"].items() if key != "decode_samples"}
                say(f"profiled run: {summary}")
        print_table(report)
    finally:
        (out_dir / "bench-vs-sglang.json").write_text(json.dumps(report, indent=1))
        client.close()
        servers.stop()
        tails = {name: (logs / f"{name}.log").read_bytes()[-3000:].decode(errors="replace")
                 for name in servers.processes if (logs / f"{name}.log").exists()}
        (out_dir / "server-log-tails.json").write_text(json.dumps(tails, indent=1))


def hold_conveyor(args: argparse.Namespace) -> None:
    """`conveyor` mode: the Conveyor stack of a benchmark run, started and held until SIGTERM or Ctrl-C."""
    signal.signal(signal.SIGTERM, interrupt)
    logs = Path(args.out or os.environ.get("TMPDIR", "/tmp")) / "bench-vs-sglang-conveyor"
    logs.mkdir(parents=True, exist_ok=True)
    servers = Servers(args, logs)
    try:
        url = servers.start_conveyor()
        say(f"conveyor ready at {url} (logs in {logs}; decode metrics on :{METRICS_PORTS['decode']}); "
            "stop with SIGTERM")
        while all(process.poll() is None for process in servers.processes.values()):
            time.sleep(1)
        say("a Conveyor process exited; stopping the rest")
    except KeyboardInterrupt:
        pass
    finally:
        servers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["bench", "nats-client", "bench-once", "serving-loop", "conveyor"], default="bench")
    parser.add_argument("--model", required=True, help="Model directory (config + tokenizer; weights are dummy).")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=2, help=(
        "Rounds per concurrency; the median is kept. Even, so that each order runs as often as its reverse."))
    parser.add_argument("--input-len", type=int, default=1024, help="Longest prompt, in tokens.")
    parser.add_argument("--output-len", type=int, default=512, help="Most new tokens per request.")
    parser.add_argument("--range-ratio", type=float, default=0.25,
                        help="Lengths are drawn from [ratio × len, len] (0.25: prompts 256–1024, outputs 128–512).")
    parser.add_argument("--prompts-per-stream", type=int, default=2, help="Requests per run = concurrency × this.")
    parser.add_argument("--min-prompts", type=int, default=8)
    # Fresh prompts per run by default: a server kept between runs has the last run's prompts in its prefix cache, and
    # a Conveyor stack started since has not; with fixed seeds that server skipped most of its prefill (16 new tokens of
    # ~1,000 per prompt, read from its log) and its inter-token tail looked half as long.
    parser.add_argument("--seed-base", type=int, default=random.SystemRandom().randrange(1, 1_000_000) * 1000,
                        help="Round r at concurrency c uses bench_serving's seed BASE + 100·c + r, the same for both "
                             "systems (default: drawn per run, so no engine has seen the prompts).")
    parser.add_argument("--persistent-client", action=argparse.BooleanOptionalAction, default=True,
                        help="Keep one bench_serving process for every run (imported once) instead of one per run.")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="One discarded run per server at the highest concurrency before the measured rounds.")
    parser.add_argument("--nats-clients", type=int, default=4,
                        help="Processes publishing the load straight to NATS (0: skip that system).")
    parser.add_argument("--profile-concurrency", type=int, default=0, help="Profile Conveyor after the runs at this concurrency (one of --concurrency; 0: no).")
    parser.add_argument("--profile-s", type=int, default=20)
    parser.add_argument("--sglang-mem-fraction", type=float, default=0.35)
    parser.add_argument("--conveyor-mem-fraction", type=float, default=0.75,
                        help="SGLang's static memory fraction in the decode worker, counted with the server's share.")
    parser.add_argument("--event-loops", nargs="+", choices=["asyncio", "uvloop"],
                        help="Instead of the comparison with SGLang: Conveyor alone under the NATS clients at the first "
                             "--concurrency, once per event loop, side by side (e.g. --engine mock --event-loops "
                             "asyncio uvloop).")
    parser.add_argument("--page-size", type=int, default=16, help="KV page size of both SGLangs (Conveyor's default).")
    parser.add_argument("--max-running-requests", type=int, default=None,
                        help="Requests each SGLang runs at once (default: SGLang's choice, from its KV pool). Give both "
                             "the same limit to compare inter-token latency at equal batch sizes; a server started by "
                             "hand (--sglang-url) needs the same flag.")
    parser.add_argument("--worker-concurrency", type=int, default=512, help="Tasks each Conveyor worker holds at once.")
    parser.add_argument("--sglang-port", type=int, default=30000)
    parser.add_argument("--sglang-kv-events", action=argparse.BooleanOptionalAction, default=False,
                        help="Start the reference server with SGLang's KV events on, as Conveyor's engine runs by "
                             "default (like against like: docs/performance.md, eighth stop).")
    parser.add_argument("--sglang-kv-events-port", type=int, default=5599)
    parser.add_argument("--sglang-url", help="An SGLang server already running (started by hand: see docs/gpu.md).")
    parser.add_argument("--conveyor-url", help="A Conveyor gateway already running (this script's `conveyor` mode, on this "
                        "machine: the profile finds its processes); no NATS clients then.")
    parser.add_argument("--control", action="store_true",
                        help="Measure the SGLang server a second time in every round, on prompts of its own "
                             "(`sglang-control`): its ratios to the server are this run's noise floor, what two "
                             "identical systems differ by at this many rounds.")
    parser.add_argument("--engine", default="sglang", help="Conveyor's engine (mock: check the harness without a GPU).")
    parser.add_argument("--gateway-workers", type=int, default=1, help="Conveyor's gateway processes (--workers)")
    parser.add_argument("--decode-args", default="", help="More options for Conveyor's decode worker, as one string "
                        "(e.g. '--migration-limit 0 --coalesce-ms 2').")
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--nats-port", type=int, default=4222)
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORTS["processor"],
                        help="The held stack's processor serves /metrics here and its decode worker on the next port; "
                             "a second stack held beside the first (another configuration, compared in one lease) "
                             "needs other ports, and the bench run that measures it the same value.")
    parser.add_argument("--start-timeout-s", type=float, default=420)
    parser.add_argument("--run-timeout-s", type=float, default=300)
    parser.add_argument("--out", help="Results folder (default: $OUT, else .bench-vs-sglang/).")
    # nats-client mode
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    parser.add_argument("--num-prompts", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Set once, before anything starts or scrapes a worker: every reader of the ports reads them from here.
    METRICS_PORTS.update(processor=args.metrics_port, decode=args.metrics_port + 1)
    if args.mode == "serving-loop":
        serving_loop()
    elif args.mode == "bench-once":  # one bench_serving run, its row on stdout (the profiled load)
        args.persistent_client = False  # one run: nothing to keep
        row = bench_http(args, ServingClient(args), args.base_url, args.concurrency[0], 7,
                         Path(args.out) / "profile-run.jsonl")
        print(json.dumps(row))
    elif args.mode == "conveyor":
        hold_conveyor(args)
    elif args.mode == "nats-client":
        args.concurrency = args.concurrency[0]
        asyncio.run(nats_client(args))
    elif args.event_loops:
        compare_event_loops(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
