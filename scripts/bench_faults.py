"""Fault suite: how many streaming requests fail or hang when a process dies under load.

The shape of Dynamo's fault-injection suite: rounds of M concurrent streaming requests against worker
processes on a real nats-server (`conveyor worker ...`, as deployed; 2 processor and 2 decode replicas by
default), one fault injected into each round while its requests stream, then a table per fault:

- completed: ended with a final frame (`migrated`: of those, how many moved to another replica);
- cancelled: ended `cancelled` because the round cancelled them (the cancel storm), as asked;
- failed: an error frame, a broken or gapped stream; hung: no end within the deadline;
- wrong: completed, but the tokens differ from what the mock model produces for that prompt (its tokens
  follow from the sequence so far, so a migrated answer must equal an uninterrupted one); with
  `--engine torch` (greedy, the real model), an answer shorter or longer than asked;
- TTFT p99, ITL p99 and the longest gap between two frames, in the fault's rounds.

Faults: none, decode-sigkill, decode-sigterm, processor-sigkill, prefill-sigkill (with `--prefills`: the
disaggregated topology), encode-sigkill (with `--encoders` and `--engine torch`: every request carries an
image, through encode workers), nats-sigkill (the server, or with `--nats-nodes 3` one node of a cluster, is
killed and started again after 1 s on the same store), cancel-storm (half the requests cancelled
mid-stream), stalled-client (a client process that stops reading, SIGSTOP, with a long request in flight).

    .venv/bin/python scripts/bench_faults.py                          # every fault, 3 rounds of 32 streams
    .venv/bin/python scripts/bench_faults.py --faults decode-sigkill --rounds 10 --concurrency 64
    .venv/bin/python scripts/bench_faults.py --nats-nodes 3 --faults none,nats-sigkill,decode-sigkill
    .venv/bin/python scripts/bench_faults.py --engine torch --prefills 2 --faults none,prefill-sigkill \
        --concurrency 8 --max-tokens 24
    .venv/bin/python scripts/bench_faults.py --engine torch --encoders 2 --faults none,encode-sigkill \
        --concurrency 8 --max-tokens 24
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bus.client import PipelineClient, open_client
from bus.errors import RemoteError, ReplyGap, ReplyStreamBroken
from bus.connection import connect
from bus.server import EmbeddedNatsCluster, EmbeddedNatsServer
from bus.streams import declare_all
from bus.subjects import Names
from bus.settings import BusSettings, NatsSettings
from schemas.client import ChatMessage, ChatRequest, CompletionRequest, ImagePart, MediaUrl, StreamFormat, TextPart
from schemas.registry import Stage
from schemas.replies import FinalFrame, FinishReason
from workers.engines.mock import MockEngine, MockEngineConfig

FAULTS = ["none", "decode-sigkill", "decode-sigterm", "processor-sigkill", "prefill-sigkill", "encode-sigkill",
          "nats-sigkill", "cancel-storm", "stalled-client"]


def say(message: str) -> None:
    print(f"[faults] {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    kind: str  # completed | cancelled | failed | hung
    migrated: bool = False
    wrong: bool = False
    detail: str = ""
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)


class Cluster:
    """nats-server and the worker processes, each killable and replaceable."""

    def __init__(self, store: Path, namespace: str, args: argparse.Namespace) -> None:
        # One server, or a cluster whose first node is the one the nats fault kills.
        self.cluster = EmbeddedNatsCluster(store, size=args.nats_nodes) if args.nats_nodes > 1 else None
        self.server = self.cluster.nodes[0] if self.cluster is not None else EmbeddedNatsServer(store_dir=store)
        self.urls = self.cluster.urls if self.cluster is not None else [self.server.url]
        self.settings = BusSettings(namespace=namespace, stream_replicas=min(3, args.nats_nodes))
        self.namespace = namespace
        self.args = args
        self.workers: dict[str, list[subprocess.Popen[bytes]]] = defaultdict(list)
        self.stopped: list[subprocess.Popen[bytes]] = []
        self.replicas = {"processor": args.processors, "encode": args.encoders, "prefill": args.prefills,
                         "decode": args.decoders}
        self.mode = {(False, False): "aggregated", (False, True): "disaggregated", (True, False): "encode-aggregated",
                     (True, True): "encode-disaggregated"}[(args.encoders > 0, args.prefills > 0)]

    async def start(self) -> None:
        if self.cluster is not None:
            self.cluster.start()
        else:
            self.server.start()
        await self._declare()
        for stage, count in self.replicas.items():
            for _ in range(count):
                self.spawn(stage)

    async def _declare(self, timeout_s: float = 30.0) -> None:
        """Declare the namespace (a cluster answers once it has elected a JetStream meta leader)."""
        nc = await connect(NatsSettings(urls=self.urls), name="bench-faults-setup")
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    await declare_all(nc.jetstream(), Names(self.namespace), self.settings, nc.max_payload)
                    return
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    def spawn(self, stage: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "CONVEYOR_NAMESPACE": self.namespace,
               "CONVEYOR_NATS_URLS": ",".join(self.urls), "CONVEYOR_STREAM_REPLICAS": str(self.settings.stream_replicas), "CONVEYOR_MOCK_INTER_TOKEN_S": str(self.args.inter_token_ms / 1000),
               "CONVEYOR_MOCK_MAX_RUNNING_REQUESTS": "256", "CONVEYOR_REGISTRY_TTL_S": "3", "CONVEYOR_MODE": self.mode}
        command = [sys.executable, "-m", "workers.cli", "worker", stage, "--engine", self.args.engine, "--log-level",
                   "ERROR", "--shutdown-grace-s", "0.5"]
        self.workers[stage].append(subprocess.Popen(command, cwd=ROOT, env=env))

    def signal_one(self, stage: str, signum: signal.Signals) -> None:
        victim = self.workers[stage].pop(0)
        victim.send_signal(signum)
        self.stopped.append(victim)

    def replace_stopped(self) -> None:
        for process in self.stopped:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for stage, processes in list(self.workers.items()):
            for _ in range(self.replicas[stage] - len(processes)):
                self.spawn(stage)
        self.stopped.clear()

    async def wait_ready(self, client: PipelineClient, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        wanted = {Stage(stage): count for stage, count in self.replicas.items()}
        while time.monotonic() < deadline:
            try:
                cards = [card for card in await client.live_workers() if card.ready]
                if all(sum(card.stage == stage for card in cards) >= count for stage, count in wanted.items()):
                    return
            except Exception:  # the server may be coming back
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError("the pipeline did not get ready")

    def stop(self) -> None:
        for process in [p for processes in self.workers.values() for p in processes] + self.stopped:
            process.terminate()
        for process in [p for processes in self.workers.values() for p in processes] + self.stopped:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        if self.cluster is not None:
            self.cluster.stop()
        else:
            self.server.stop()


def expected_tokens(prompt: list[int], count: int) -> list[int]:
    engine, tokens = MockEngine(MockEngineConfig()), list(prompt)
    for _ in range(count):
        tokens.append(engine._next_token(tokens[-1], len(tokens)))
    return tokens[len(prompt):]


async def stream_one(client: PipelineClient, prompt: list[int], args: argparse.Namespace,
                     cancel_after_s: float | None) -> Outcome:
    request = request_for(client, prompt, args)
    started_s = time.monotonic()
    outcome = Outcome("hung")
    tokens: list[int] = []
    last_s = started_s
    canceller = None
    if cancel_after_s is not None:
        canceller = asyncio.create_task(_cancel_later(client, request.request_id, cancel_after_s))
    try:
        async with asyncio.timeout(args.deadline_s):
            async with await client.submit(request, first_frame_timeout_s=args.deadline_s) as stream:
                async for chunk in stream:
                    now = time.monotonic()
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - started_s
                    else:
                        outcome.gaps_s.append(now - last_s)
                    last_s = now
                    tokens.extend(chunk.token_ids)
                final = stream.terminal
        assert isinstance(final, FinalFrame)
        outcome.migrated = final.migrations > 0
        if final.finish_reason == FinishReason.CANCELLED:
            outcome.kind = "cancelled" if cancel_after_s is not None else "failed"
            outcome.detail = "cancelled unasked" if cancel_after_s is None else ""
            outcome.wrong = args.engine == "mock" and tokens != expected_tokens(prompt, len(tokens))
        else:
            outcome.kind = "completed"
            # The mock's answer is known; the torch engine's must at least be whole.
            outcome.wrong = (tokens != expected_tokens(prompt, args.max_tokens) if args.engine == "mock"
                             else len(tokens) != args.max_tokens)
    except TimeoutError:
        outcome.kind, outcome.detail = "hung", f"no end after {args.deadline_s:.0f} s"
    except RemoteError as error:
        outcome.kind, outcome.detail = "failed", f"{error.code.value}"
    except (ReplyGap, ReplyStreamBroken) as error:
        outcome.kind, outcome.detail = "failed", type(error).__name__
    finally:
        if canceller is not None:
            canceller.cancel()
    return outcome


def request_for(client: PipelineClient, prompt: list[int], args: argparse.Namespace) -> CompletionRequest | ChatRequest:
    fields = {"request_id": f"fault-{uuid.uuid4().hex[:12]}", "reply_to": client.new_inbox(), "model": args.model,
              "max_tokens": args.max_tokens, "stream_format": StreamFormat.TOKENS, "temperature": 0.0, "ignore_eos": True}
    if not args.encoders:
        return CompletionRequest(prompt=prompt, **fields)
    # Through the encode workers: a picture of its own per request (no cache hit), with the prompt as text.
    image = ImagePart(image_url=MediaUrl(url=picture(prompt)))
    text = TextPart(text=" ".join(str(token) for token in prompt[:16]))
    return ChatRequest(messages=[ChatMessage(role="user", content=[text, image])], **fields)


def picture(prompt: list[int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (prompt[0] % 256, prompt[1] % 256, prompt[2] % 256)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def _cancel_later(client: PipelineClient, request_id: str, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await client.cancel(request_id, "bench cancel storm")


def stalled_client(url: str, namespace: str, model: str) -> subprocess.Popen[bytes]:
    """A client process with a long stream in flight that stops reading (SIGSTOP once subscribed)."""
    code = f"""
import asyncio, os, signal, sys, uuid
sys.path.insert(0, {str(ROOT)!r})
from bus.client import open_client
from bus.settings import BusSettings, NatsSettings
from schemas.client import CompletionRequest
async def main():
    async with open_client(NatsSettings(urls=[{url!r}]), BusSettings(namespace={namespace!r}), "stalled") as client:
        request = CompletionRequest(request_id="stalled-" + uuid.uuid4().hex[:8], reply_to=client.new_inbox(),
                                    model={model!r}, prompt=[5, 6, 7], max_tokens=5000)
        stream = await client.submit(request)
        await stream.__aiter__().__anext__()
        os.kill(os.getpid(), signal.SIGSTOP)
asyncio.run(main())
"""
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


async def run_round(client: PipelineClient, cluster: Cluster, fault: str, args: argparse.Namespace,
                    rng: random.Random) -> list[Outcome]:
    vocab = 32000 if args.engine == "mock" else 49152
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 64))] for _ in range(args.concurrency)]
    stream_s = args.max_tokens * args.inter_token_ms / 1000
    cancels = [rng.random() < 0.5 if fault == "cancel-storm" else False for _ in prompts]
    stalled = stalled_client(cluster.urls[-1], cluster.namespace, args.model) if fault == "stalled-client" else None
    if stalled is not None:
        await asyncio.sleep(1.0)  # subscribed, one frame read, stopped
    tasks = []
    for prompt, cancel in zip(prompts, cancels, strict=True):
        cancel_after_s = rng.uniform(0.2, 0.8) * stream_s if cancel else None
        tasks.append(asyncio.create_task(stream_one(client, prompt, args, cancel_after_s)))
        await asyncio.sleep(args.spread_s / args.concurrency)
    await asyncio.sleep(max(0.0, args.fault_at_s - args.spread_s))
    await inject(cluster, fault)
    outcomes = await asyncio.gather(*tasks)
    if stalled is not None:
        stalled.kill()
        stalled.wait()
    if fault == "nats-sigkill" or fault.endswith(("sigkill", "sigterm")):
        cluster.replace_stopped()
        await cluster.wait_ready(client)
    return outcomes


async def inject(cluster: Cluster, fault: str) -> None:
    if fault == "nats-sigkill":
        cluster.server.halt(signal.SIGKILL)
        await asyncio.sleep(1.0)
        cluster.server.start()
    elif fault.endswith(("-sigkill", "-sigterm")):
        stage, _, kind = fault.rpartition("-")
        cluster.signal_one(stage, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)


async def recoveries(client: PipelineClient) -> dict[str, float]:
    """`conveyor_migrations_total` by outcome, summed over the live decode workers' /metrics."""
    totals: dict[str, float] = defaultdict(float)
    urls = [card.metrics_url for card in await client.live_workers() if card.stage == Stage.DECODE and card.metrics_url]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for url in urls:
            try:
                async with session.get(url) as response:
                    text = await response.text()
            except (aiohttp.ClientError, TimeoutError):
                continue  # a worker on its way out
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "conveyor_migrations_total":
                        totals[sample.labels["outcome"]] += sample.value
    return totals


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def table(results: dict[str, list[Outcome]]) -> str:
    lines = ["| fault | requests | completed | migrated | cancelled (asked) | failed | hung | wrong | TTFT p99 ms | "
             "ITL p99 ms | longest gap ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fault, outcomes in results.items():
        kinds = [o.kind for o in outcomes]
        count = kinds.count
        ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        gaps = [gap for o in outcomes for gap in o.gaps_s]
        lines.append(f"| {fault} | {len(outcomes)} | {count('completed')} | {sum(o.migrated for o in outcomes)} | "
                     f"{count('cancelled')} | {count('failed')} | {count('hung')} | {sum(o.wrong for o in outcomes)} | "
                     f"{p99(ttfts) * 1000:.0f} | {p99(gaps) * 1000:.1f} | {max(gaps, default=0) * 1000:.0f} |")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    args.model = "mock" if args.engine == "mock" else "SmolLM2-135M-Instruct"
    faults = FAULTS if args.faults == "all" else args.faults.split(",")
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise SystemExit(f"unknown faults: {', '.join(sorted(unknown))}; choose from {', '.join(FAULTS)}")
    if "prefill-sigkill" in faults and not args.prefills:
        raise SystemExit("prefill-sigkill needs prefill workers: add --prefills 2")
    if "encode-sigkill" in faults and not args.encoders:
        raise SystemExit("encode-sigkill needs encode workers: add --encoders 2 (and --engine torch)")
    if args.prefills and args.engine != "torch":
        raise SystemExit("disaggregated serving moves KV between torch engines (the mock runs every prompt itself): "
                         "add --engine torch")
    if args.encoders and args.engine != "torch":
        raise SystemExit("encode workers run the torch engine's vision tower: add --engine torch")
    rng = random.Random(args.seed)
    namespace = f"faults{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="conveyor-faults-") as store:
        cluster = Cluster(Path(store), namespace, args)
        try:
            await cluster.start()
            async with open_client(NatsSettings(urls=cluster.urls), cluster.settings, "bench-faults") as client:
                await cluster.wait_ready(client)
                replicas = " + ".join(f"{count} {stage}" for stage, count in cluster.replicas.items() if count)
                say(f"{replicas} replicas ({cluster.mode}) on {args.nats_nodes} NATS node(s) ready ({args.engine} engine, "
                    f"{args.inter_token_ms} ms/token); {args.rounds} rounds × {args.concurrency} streams per fault")
                results: dict[str, list[Outcome]] = {}
                for fault in faults:
                    results[fault] = []
                    for round_index in range(args.rounds):
                        # Decode workers count the prompts they ran themselves (their prefill died) and the images
                        # they encoded themselves (their encode worker died); those workers outlive these faults.
                        before = await recoveries(client)
                        outcomes = await run_round(client, cluster, fault, args, rng)
                        recovered = {key: count - before.get(key, 0.0) for key, count in (await recoveries(client)).items()}
                        results[fault] += outcomes
                        bad = [o for o in outcomes if o.kind in ("failed", "hung") or o.wrong]
                        say(f"{fault} round {round_index + 1}: {sum(o.kind == 'completed' for o in outcomes)} completed, "
                            f"{sum(o.migrated for o in outcomes)} migrated, {len(bad)} bad"
                            + (f" ({', '.join(sorted({o.detail or 'wrong tokens' for o in bad}))})" if bad else "")
                            + "".join(f", {key}: {count:.0f}" for key, count in recovered.items() if count > 0))
        finally:
            cluster.stop()
    print(table(results))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default="all", help=f"comma-separated, or all: {', '.join(FAULTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fault")
    parser.add_argument("--concurrency", type=int, default=32, help="streams per round")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--inter-token-ms", type=float, default=10.0, help="the mock engine's time per token")
    parser.add_argument("--processors", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=2)
    parser.add_argument("--prefills", type=int, default=0,
                        help="prefill replicas (> 0: disaggregated serving; needs --engine torch)")
    parser.add_argument("--encoders", type=int, default=0,
                        help="encode replicas (> 0: every request carries an image; needs --engine torch)")
    parser.add_argument("--spread-s", type=float, default=1.0, help="requests of a round start over this long")
    parser.add_argument("--fault-at-s", type=float, default=0.7, help="the fault, this long into the round")
    parser.add_argument("--deadline-s", type=float, default=60.0, help="a stream not ended by then is hung")
    parser.add_argument("--engine", choices=["mock", "torch"], default="mock",
                        help="mock (scale; its tokens are known, so wrong answers are counted) or torch (the real model)")
    parser.add_argument("--nats-nodes", type=int, default=1,
                        help="NATS servers: 1, or a cluster (streams replicated 3 times; nats-sigkill kills one node)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
