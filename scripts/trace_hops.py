"""Where one request's first token spends its time, hop by hop: client → processor → decode → client, one at a time.

It starts an embedded nats-server and a processor and a decode worker (the mock engine, 5 ms to the first token, or
SGLang with --engine sglang) as their own processes, with time stamps added at each point of a task's path by wrapping functions at start-up (nothing
in the project changes). Then it sends --requests token-id requests one after another, 20 ms apart (an idle pipeline:
what one stream sees), and prints the median time between consecutive points:

    client submits → publishes → task stored in the stream (JetStream's own timestamp) → on the worker's socket →
    handed to a handler task → the stage's handler starts → [processor] publishes the next task → ... →
    [decode] the engine starts → the engine's first token → the first frame published → the client has it

    .venv/bin/python scripts/trace_hops.py --requests 300
    .venv/bin/python scripts/trace_hops.py --requests 300 --root /tmp/base   # another checkout's workers

On the GPU machine, SGLang as the engine, each request paired with the same prompt (token ids) sent to SGLang's own
server (`/generate`, streamed), alternating which goes first; two more points split the engine's part (SGLang's
tokenizer manager dispatching the request to its scheduler, and receiving the first output back):

    bash scripts/gpu_run.sh python3 scripts/trace_hops.py --engine sglang --model .gpu/smol \
        --prompt-tokens 256 1024 --server-url http://127.0.0.1:30000

The decode worker's SGLang gets CONVEYOR_SGLANG_* from the environment (default here: 30% of the GPU, page 16,
asleep while idle).

`--load-streams N` keeps N other streams running through the same pipeline meanwhile (each a fresh request of
`--load-tokens` tokens as soon as its last ended): which hops grow when the stages are busy, as at 16 streams (the
stack's first token read +5 ms over the server's there on the H100, docs/performance.md). Under load the three points
stamped without a request id (on the socket, the first frame out) cannot be told apart from the load's and are left
out: their spans read as one.

    .venv/bin/python scripts/trace_hops.py --requests 200 --load-streams 16

The workers and the gateway keep their loops warm for CONVEYOR_STAY_WARM_S (default 10 s) after work, as every
deployment's do; `CONVEYOR_STAY_WARM_S=0` in the environment measures them cold. `--keep-warm-ms N` (the experiment
that came before that setting) also wakes this client's loop, and each worker's consumer, every N ms.

With `--gateway-port`, every other pair of requests goes through a gateway (`conveyor gateway`, traced like the
stages) as an HTTP client's would, and a second table splits those requests' path: the gateway handing the request to
its handler, its publish, the stages' points as above, the first frame reaching the gateway's socket and its SSE event
written, then the HTTP client's first event.

All processes stamp `time.time()` of one machine, so their stamps compare. The wrappers cost a few microseconds a
point; the first token's total (printed last) is a little slower than unwrapped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MSG_ID = "Nats-Msg-Id"
STAGES = ("processor", "decode")
# The points of a request's path, in order.
POINTS = ["submit", "publish@processor",
          "processor.stored", "processor.socket", "processor.handed", "processor.handler", "publish@decode",
          "decode.stored", "decode.socket", "decode.handed", "decode.handler",
          "engine.start", "engine.first_token", "first_frame_out", "client_first"]
# Inside SGLang's engine: its tokenizer manager hands the request to the scheduler, and receives the first output.
SGLANG_POINTS = ["sglang.dispatched", "sglang.first_output"]
# Through the gateway: aiohttp hands the request to the gateway's handler (before the publish), the first frame is
# parsed off the gateway's socket and its SSE event written (before the HTTP client has it).
GATEWAY_IN, GATEWAY_OUT = ["gateway.request"], ["gateway.socket", "gateway.written"]
ENGINE_CLASSES = {"mock": ("workers.engines.mock", "MockEngine"),
                  "sglang": ("workers.engines.sglang_engine", "SGLangEngine")}


# Stamped without a request id (nats-py's socket parse; frames leave in batches): found as the first stamp after the
# request's point before them, which another stream's stamp may be.
UNNAMED_POINTS = ("processor.socket", "decode.socket", "first_frame_out", "gateway.request", "gateway.socket")
TRACED_PREFIX = "hop"  # the traced requests' ids; the load's start otherwise


def points_of(engine: str, loaded: bool = False, via_gateway: bool = False) -> list[str]:
    points = list(POINTS)
    if via_gateway:
        points = points[:1] + GATEWAY_IN + points[1:-1] + GATEWAY_OUT + points[-1:]
    if engine == "sglang":
        at = points.index("engine.first_token")
        points = points[:at] + SGLANG_POINTS + points[at:]
    return [point for point in points if not (loaded and point in UNNAMED_POINTS)]


# ----- in each worker process: wrap the path's functions, then run the worker ---------------------------------------

def run_traced_worker(stage: str, engine: str, out_path: str, argv: list[str], keep_warm_ms: float = 0.0) -> None:
    out = open(out_path, "w", buffering=1)  # noqa: SIM115 (open for the process's life)

    def stamp(point: str, request_id: str | None = None, at_s: float | None = None) -> None:
        out.write(json.dumps({"point": point, "request_id": request_id, "t": at_s or time.time()}) + "\n")

    if stage == "gateway":
        _wrap_publish(stamp)
        _wrap_gateway(stamp)
        from workers.cli import app

        sys.argv = ["conveyor", "gateway", *argv]
        app()
        return
    _wrap_consumer(stage, stamp)
    if keep_warm_ms:
        _keep_consumer_loop_warm(keep_warm_ms)
    _wrap_socket(stage, stamp)
    _wrap_publish(stamp)
    if stage == "decode":
        _wrap_engine_and_frames(engine, stamp)
        if engine == "sglang":
            _wrap_sglang(stamp)
    from workers.cli import app

    sys.argv = ["conveyor", "worker", stage, *argv]
    app()


def _wrap_consumer(stage: str, stamp: Callable[..., None]) -> None:
    from bus import consumer

    spawn, run_handler = consumer.WorkConsumer._spawn, consumer.WorkConsumer._run_handler

    def traced_spawn(self: Any, msg: Any) -> None:
        request_id = (msg.headers or {}).get(MSG_ID)
        stored = msg.metadata.timestamp
        stamp(f"{stage}.stored", request_id, stored.timestamp() if stored else None)
        stamp(f"{stage}.handed", request_id)
        spawn(self, msg)

    async def traced_run_handler(self: Any, msg: Any, task: Any) -> None:
        handler = self._handler

        async def stamped(task: Any, delivery: Any) -> None:
            stamp(f"{stage}.handler", task.request_id)
            await handler(task, delivery)

        self._handler = stamped
        try:
            await run_handler(self, msg, task)
        finally:
            self._handler = handler

    consumer.WorkConsumer._spawn = traced_spawn  # type: ignore[method-assign]
    consumer.WorkConsumer._run_handler = traced_run_handler  # type: ignore[method-assign]


def _keep_consumer_loop_warm(interval_ms: float) -> None:
    """The worker's event loop wakes every `interval_ms` while its consumer runs."""
    from bus import consumer

    run = consumer.WorkConsumer.run

    async def run_awake(self: Any) -> None:
        ticking = asyncio.create_task(tick(interval_ms))
        try:
            await run(self)
        finally:
            ticking.cancel()

    consumer.WorkConsumer.run = run_awake  # type: ignore[method-assign]


async def tick(interval_ms: float) -> None:
    while True:
        await asyncio.sleep(interval_ms / 1000)


def _wrap_socket(stage: str, stamp: Callable[..., None]) -> None:
    """When nats-py parsed a task off the socket (a JetStream delivery: its reply is an ack subject)."""
    import nats.aio.client

    process_msg = nats.aio.client.Client._process_msg

    async def traced(self: Any, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        if reply.startswith(b"$JS.ACK"):
            stamp(f"{stage}.socket")
        await process_msg(self, sid, subject, reply, data, headers)

    nats.aio.client.Client._process_msg = traced  # type: ignore[method-assign]


def _wrap_publish(stamp: Callable[..., None]) -> None:
    from bus import publish

    publish_until_acked = publish.TaskPublisher._publish_until_acked

    async def traced(self: Any, subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        stamp("publish@decode" if ".decode" in subject else "publish@processor", headers.get(MSG_ID))
        return await publish_until_acked(self, subject, payload, headers)

    publish.TaskPublisher._publish_until_acked = traced  # type: ignore[method-assign]


def _wrap_gateway(stamp: Callable[..., None]) -> None:
    """The gateway's request handed to its handler (before the request id exists), each reply frame parsed off its
    socket (a message on an inbox; JetStream's publish acks among them, long before a first token), and each SSE
    event written (the assembly keeps each request's first)."""
    import nats.aio.client
    from aiohttp import web

    from workers import gateway

    errors, process_msg, send_unless_empty = (gateway.Gateway._errors, nats.aio.client.Client._process_msg,
                                              gateway._send_unless_empty)

    @web.middleware
    async def traced_errors(self: Any, request: Any, handler: Any) -> Any:
        if request.method == "POST":
            stamp("gateway.request")
        return await errors(self, request, handler)

    async def traced_process_msg(self: Any, sid: int, subject: bytes, reply: bytes, data: bytes,
                                 headers: bytes) -> None:
        if subject.startswith(b"_INBOX"):
            stamp("gateway.socket")
        await process_msg(self, sid, subject, reply, data, headers)

    async def traced_send(response: Any, event: Any) -> None:
        await send_unless_empty(response, event)
        if event is not None:
            stamp("gateway.written", response.headers.get("x-request-id"))

    gateway.Gateway._errors = traced_errors  # type: ignore[method-assign]
    nats.aio.client.Client._process_msg = traced_process_msg  # type: ignore[method-assign]
    gateway._send_unless_empty = traced_send  # type: ignore[assignment]


def _wrap_engine_and_frames(engine: str, stamp: Callable[..., None]) -> None:
    import importlib

    from bus import connection, journal, replies

    module, name = ENGINE_CLASSES[engine]
    engine_class = getattr(importlib.import_module(module), name)
    generate = engine_class.generate

    async def traced_generate(self: Any, request: Any) -> Any:
        stamp("engine.start", request.request_id)
        first = True
        async for output in generate(self, request):
            if first and output.token_ids:
                stamp("engine.first_token", request.request_id)
                first = False
            yield output

    publish_frames = connection.publish_frames

    async def traced_publish_frames(nc: Any, *frames: tuple[bytes, bytes]) -> None:
        stamp("frames_out")  # matched to its request by time: the first after the engine's first token
        await publish_frames(nc, *frames)

    engine_class.generate = traced_generate
    replies.publish_frames = journal.publish_frames = traced_publish_frames  # type: ignore[assignment]


def _wrap_sglang(stamp: Callable[..., None]) -> None:
    """SGLang's tokenizer manager (in the decode worker's process): dispatching a request to the scheduler, and each
    batch of outputs coming back (the request ids it names; the first after dispatch is the first token's)."""
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    send_one_request, handle_batch_output = TokenizerManager._send_one_request, TokenizerManager._handle_batch_output

    def traced_send(self: Any, tokenized: Any) -> Any:
        result = send_one_request(self, tokenized)
        stamp("sglang.dispatched", tokenized.rid)
        return result

    async def traced_handle(self: Any, outputs: Any) -> Any:
        at_s = time.time()
        for rid in outputs.rids:
            stamp("sglang.first_output", rid, at_s)  # every batch: the assembly keeps each request's first
        return await handle_batch_output(self, outputs)

    TokenizerManager._send_one_request = traced_send  # type: ignore[method-assign]
    TokenizerManager._handle_batch_output = traced_handle  # type: ignore[method-assign]


# ----- the driver ----------------------------------------------------------------------------------------------------

def worker_env(args: argparse.Namespace) -> dict[str, str]:
    if args.engine == "mock":
        from bench_pipeline import mock_env

        return mock_env(inter_token_ms=10)
    # The caller's settings win; these are what gpu_hold.sh gives a stack beside the held server.
    return {"CONVEYOR_SGLANG_MEM_FRACTION_STATIC": "0.3", "CONVEYOR_SGLANG_PAGE_SIZE": "16",
            "CONVEYOR_SGLANG_EXTRA_SERVER_ARGS": '{"sleep_on_idle": true}',
            **{key: value for key, value in os.environ.items() if key.startswith("CONVEYOR_SGLANG_")}}


def worker_args(args: argparse.Namespace) -> list[str]:
    engine = ["--engine", args.engine, "--log-level", "WARNING"]
    return engine if args.engine == "mock" else [*engine, "--model", args.model, "--load-format", "dummy"]


async def wait_until(what: str, ready: Callable[[], Awaitable[Any]], workers: list[subprocess.Popen[bytes]],
                     timeout_s: float) -> Any:
    """`ready()`'s first truthy answer, polled; a started process that exits first (SGLang that cannot start, say)
    ends the wait at once rather than at the timeout."""
    deadline_s = time.monotonic() + timeout_s
    while not (answer := await ready()):
        if (gone := next((worker for worker in workers if worker.poll() is not None), None)) is not None:
            raise RuntimeError(f"{what}: {' '.join(map(str, gone.args[:6]))} ... exited with {gone.returncode}")
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"{what}: not ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)
    return answer


async def served_model(client: Any) -> str | None:
    """The one model the started workers serve, once they are ready (SGLang takes a minute or two to start)."""
    from bus.registry import ready_models

    return next(iter(ready_models(await client.live_workers())), None)


async def answers(session: Any, url: str) -> bool:
    try:
        async with session.get(url) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def pin_each(cores: list[int], server_pid: int | None, workers: list[subprocess.Popen[bytes]]) -> None:
    """The nats-server on two cores, then one core each: processor, decode worker, gateway, this client. Every thread
    of each process, not its children: SGLang's scheduler stays free."""
    from workers.engines.cpu_pinning import pin_threads

    if server_pid is not None:
        pin_threads(server_pid, cores[:2])
    for worker, core in zip(workers, cores[2:]):
        pin_threads(worker.pid, [core])
    pin_threads(os.getpid(), [cores[2 + len(workers)]])
    print(f"[trace-hops] pinned: nats-server {cores[:2]}, workers and client {cores[2:3 + len(workers)]}",
          file=sys.stderr, flush=True)


async def first_event(session: Any, url: str, body: dict[str, Any]) -> tuple[str | None, float, float]:
    """Posts `body` (a streamed request): its `x-request-id` (None if the server sends none), when it was posted and
    when its first event with output came (`time.time()`); read to the end, so the next request finds the server
    idle."""
    started_s, first_s = time.time(), 0.0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {(await response.text())[:300]}")
        async for line in response.content:
            if not first_s and line.startswith(b"data: {") and b'"text"' in line:
                first_s = time.time()
    if not first_s:
        raise RuntimeError(f"{url}: the stream ended without output")
    return response.headers.get("x-request-id"), started_s, first_s


async def first_event_s(session: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds from posting `body` to its first event with output."""
    _, started_s, first_s = await first_event(session, url, body)
    return first_s - started_s


def server_body(token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """SGLang's own `/generate`, streamed, with the prompt as token ids."""
    return {"input_ids": token_ids, "stream": True, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}


def gateway_body(model: str, token_ids: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": token_ids, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def drive(args: argparse.Namespace, trace_dir: Path) -> tuple[dict[str, dict[str, float]],
                                                                 dict[str, dict[str, float]], dict[str, float],
                                                                 dict[str, float]]:
    """Each request's points stamped in this process: those sent over NATS, and those sent through the gateway (with
    --gateway-port; by the gateway's request id); the gateway's first-token seconds per request id, and the
    server's for each (with --server-url)."""
    import random

    import aiohttp

    sys.path.insert(0, str(args.root))
    sys.path.insert(0, str(ROOT / "scripts"))
    from bus.client import open_client
    from bus.server import EmbeddedNatsServer
    from bus.settings import BusSettings, NatsSettings
    from schemas.client import CompletionRequest, StreamFormat

    client_points: dict[str, dict[str, float]] = {}
    gateway_points: dict[str, dict[str, float]] = {}
    server_s: dict[str, float] = {}
    gateway_s: dict[str, float] = {}

    def stamp(point: str, request_id: str | None = None, at_s: float | None = None) -> None:
        if request_id is not None:
            client_points.setdefault(request_id, {})[point] = at_s or time.time()

    async def through_conveyor(client: Any, model: str, request_id: str, token_ids: list[int]) -> None:
        request = CompletionRequest(request_id=request_id, reply_to=client.new_inbox(), model=model,
                                    prompt=token_ids, max_tokens=args.max_tokens, stream_format=StreamFormat.TOKENS)
        submitted_s, first_s = time.time(), 0.0
        async with await client.submit(request, first_frame_timeout_s=60) as stream:
            async for chunk in stream:
                if not first_s and chunk.token_ids:
                    first_s = time.time()
        client_points[request_id].update(submit=submitted_s, client_first=first_s)

    async def keep_streaming(client: Any, model: str, stream_index: int, stop: asyncio.Event) -> int:
        """One load stream: a request of --load-tokens tokens after another until `stop`; how many ended."""
        load_rng, ended = random.Random(10_000 + stream_index), 0
        while not stop.is_set():
            request = CompletionRequest(
                request_id=f"load{stream_index:03d}-{uuid.uuid4().hex[:6]}", reply_to=client.new_inbox(), model=model,
                prompt=[load_rng.randrange(1000, 30000) for _ in range(256)], max_tokens=args.load_tokens,
                stream_format=StreamFormat.TOKENS)
            async with await client.submit(request, first_frame_timeout_s=60) as stream:
                async for _ in stream:
                    pass
            ended += 1
        return ended

    _wrap_publish(stamp)
    rng = random.Random(args.seed)
    low, high = args.prompt_tokens
    with EmbeddedNatsServer() as server:
        namespace = f"hops{uuid.uuid4().hex[:6]}"
        # The checkout first, then what the caller made importable (gpu_run.sh: SGLang and the carried packages).
        python_path = os.pathsep.join(filter(None, [str(args.root), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, **worker_env(args), "CONVEYOR_NATS_URLS": server.url, "CONVEYOR_NAMESPACE": namespace,
               "PYTHONPATH": python_path}

        def traced(stage: str, stage_args: list[str]) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, __file__, "--as-worker", stage, "--engine", args.engine,
                                     "--trace-file", str(trace_dir / f"{stage}.jsonl"), "--root", str(args.root),
                                     "--keep-warm-ms", str(args.keep_warm_ms), "--", *stage_args],
                                    cwd=args.root, env=env)

        workers = [traced(stage, worker_args(args)) for stage in STAGES]
        if args.gateway_port:
            workers.append(traced("gateway", ["--host", "127.0.0.1", "--port", str(args.gateway_port),
                                              "--log-level", "WARNING"]))
        gateway_url = f"http://127.0.0.1:{args.gateway_port}/v1/completions"
        try:
            async with (open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "hops") as client,
                        aiohttp.ClientSession() as session):
                model = await wait_until("the workers", lambda: served_model(client), workers, args.start_timeout_s)
                if args.keep_warm_ms:
                    ticking = asyncio.create_task(tick(args.keep_warm_ms))  # noqa: F841 (ends with the loop)
                if args.gateway_port:
                    health_url = f"http://127.0.0.1:{args.gateway_port}/health"
                    await wait_until("the gateway", lambda: answers(session, health_url), workers, args.start_timeout_s)
                if args.pin:
                    pin_each(args.pin, server.pid, workers)
                stop_load = asyncio.Event()
                load = [asyncio.create_task(keep_streaming(client, model, index, stop_load))
                        for index in range(args.load_streams)]
                print(f"[trace-hops] workers ready ({args.engine}, model {model}); "
                      f"{args.warmup} + {args.requests} requests"
                      + (f", beside {args.load_streams} streams of {args.load_tokens} tokens" if load else ""),
                      file=sys.stderr, flush=True)
                for index in range(args.warmup + args.requests):
                    request_id = f"hop{index:05d}-{uuid.uuid4().hex[:6]}"
                    # Random ids from the middle of the vocabulary: a fresh prompt each time, nothing cached.
                    token_ids = [rng.randrange(1000, 30000) for _ in range(rng.randint(low, high))]
                    # Which goes first alternates every request; with a gateway, every other pair goes through it.
                    server_first, over_http = index % 2 == 1, bool(args.gateway_port) and index % 4 >= 2
                    if args.server_url and server_first:
                        server_s[request_id] = await first_event_s(session, f"{args.server_url}/generate",
                                                                   server_body(token_ids, args.max_tokens))
                        await asyncio.sleep(args.gap_s)
                    if over_http:
                        gateway_id, posted_s, first_s = await first_event(
                            session, gateway_url, gateway_body(model, token_ids, args.max_tokens))
                        gateway_s[request_id] = first_s - posted_s
                        if gateway_id is not None and index >= args.warmup:
                            gateway_points[gateway_id] = {"submit": posted_s, "client_first": first_s}
                    else:
                        await through_conveyor(client, model, request_id, token_ids)
                    if args.server_url and not server_first:
                        await asyncio.sleep(args.gap_s)
                        server_s[request_id] = await first_event_s(session, f"{args.server_url}/generate",
                                                                   server_body(token_ids, args.max_tokens))
                    if index < args.warmup:
                        for kept in (client_points, server_s, gateway_s):
                            kept.pop(request_id, None)
                    if (index + 1) % 100 == 0:
                        print(f"[trace-hops] {index + 1} sent", file=sys.stderr, flush=True)
                    await asyncio.sleep(args.gap_s)
                stop_load.set()
                if load:
                    ended = sum(await asyncio.gather(*load))
                    print(f"[trace-hops] the load ran {ended} requests beside them", file=sys.stderr, flush=True)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=60)
    # The load's requests were stamped too (at the client's publish): only the traced ones are reported.
    traced = {request_id: points for request_id, points in client_points.items()
              if request_id.startswith(TRACED_PREFIX)}
    return traced, gateway_points, gateway_s, server_s


# Points stamped without a request id: (the point, as stamped, found as the first stamp after this point of the
# request's). The gateway's are looked for only in requests sent through it.
UNNAMED_AFTER = [("processor.socket", "processor.socket", "processor.stored"),
                 ("decode.socket", "decode.socket", "decode.stored"),
                 ("first_frame_out", "frames_out", "engine.first_token")]
GATEWAY_UNNAMED_AFTER = [("gateway.request", "gateway.request", "submit"),
                         ("gateway.socket", "gateway.socket", "first_frame_out")]


def assemble(by_request: dict[str, dict[str, float]], trace_dir: Path,
             via_gateway: bool = False) -> dict[str, dict[str, float]]:
    """Each request's points (the client's, given) with the workers' added: those stamped with its id, and for those
    stamped without one, the first stamp of that point after the request's point before it."""
    unnamed: dict[str, list[float]] = {}
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["request_id"] is None:
                unnamed.setdefault(record["point"], []).append(record["t"])
            elif record["request_id"] in by_request:
                by_request[record["request_id"]].setdefault(record["point"], record["t"])
    for stamps in unnamed.values():
        stamps.sort()
    for points in by_request.values():
        for point, stamped_as, after in UNNAMED_AFTER + (GATEWAY_UNNAMED_AFTER if via_gateway else []):
            found = _first_after(unnamed.get(stamped_as, []), points.get(after))
            if found is not None:
                points[point] = found
    return by_request


def _first_after(stamps: list[float], after: float | None) -> float | None:
    return None if after is None else next((t for t in stamps if t >= after), None)


def report(by_request: dict[str, dict[str, float]], engine: str, gateway_s: dict[str, float],
           server_s: dict[str, float], load_streams: int = 0,
           through_gateway: dict[str, dict[str, float]] | None = None) -> None:
    what = "mock engine: 5 ms to the first token" if engine == "mock" else engine
    beside = f", beside {load_streams} other streams" if load_streams else ""
    complete = report_path(f"one at a time{beside}, medians in ms ({what})", by_request,
                           points_of(engine, loaded=load_streams > 0))
    if gateway_s:
        print(f"through the gateway (HTTP, token ids), {len(gateway_s)} requests: "
              f"p50 {1000 * statistics.median(gateway_s.values()):.2f} ms")
    if through_gateway:
        report_path(f"through the gateway{beside}, one at a time, medians in ms", through_gateway,
                    points_of(engine, loaded=load_streams > 0, via_gateway=True))
    paired = [request_id for request_id in complete if request_id in server_s]
    if paired:
        report_paired({request_id: complete[request_id] for request_id in paired}, gateway_s, server_s)


def report_path(title: str, by_request: dict[str, dict[str, float]],
                points_in_order: list[str]) -> dict[str, dict[str, float]]:
    """One table of the path's steps, over the requests that have every point; those requests."""
    complete = {request_id: points for request_id, points in by_request.items()
                if all(point in points for point in points_in_order)}
    print(f"{len(complete)} requests {title}")
    if not complete:
        return complete
    total_ms = 0.0
    for before, point in pairwise(points_in_order):
        step_ms = statistics.median(1000 * (points[point] - points[before]) for points in complete.values())
        total_ms += step_ms
        print(f"  → {point:<22} {step_ms:7.3f}   {total_ms:7.3f}")
    ttfts_ms = [1000 * (points["client_first"] - points["submit"]) for points in complete.values()]
    print(f"first token: p50 {statistics.median(ttfts_ms):.2f} ms, p90 {sorted(ttfts_ms)[int(0.9 * len(ttfts_ms))]:.2f} ms")
    return complete


def report_paired(points_of_request: dict[str, dict[str, float]], gateway_s: dict[str, float],
                  server_s: dict[str, float]) -> None:
    """Each span of Conveyor's path against the server's whole first token for the same prompt (median of the
    per-prompt differences, with its 95% bootstrap interval)."""
    from bench_ttft import median_interval

    server_ms = [1000 * server_s[request_id] for request_id in points_of_request]
    print(f"paired with SGLang's own server, {len(server_ms)} prompts; its first token (HTTP, token ids): "
          f"p50 {statistics.median(server_ms):.2f} ms")
    spans = [("Conveyor's whole first token (NATS client)", "submit", "client_first"),
             ("the engine's part (start → first token)", "engine.start", "engine.first_token")]
    if all("sglang.dispatched" in points for points in points_of_request.values()):
        spans.append(("SGLang's scheduler round trip (dispatch → output)", "sglang.dispatched", "sglang.first_output"))
    rows = [(label, [1000 * (points[end] - points[start] - server_s[request_id])
                     for request_id, points in points_of_request.items()]) for label, start, end in spans]
    if gateway_s:
        rows.insert(0, ("Conveyor's whole first token (HTTP, the gateway)",
                        [1000 * (seconds - server_s[request_id]) for request_id, seconds in gateway_s.items()
                         if request_id in server_s]))
    for label, differences in rows:
        low, high = median_interval(differences, seed=1)
        print(f"  {label:<52} − server: median {statistics.median(differences):+7.3f} ms  (95%: {low:+.3f} to {high:+.3f})"
              f", {len(differences)} prompts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="requests measured (default 300)")
    parser.add_argument("--warmup", type=int, default=10, help="requests sent first and not counted (default 10)")
    parser.add_argument("--engine", choices=sorted(ENGINE_CLASSES), default="mock",
                        help="the decode worker's engine (sglang: on the GPU machine, with --model)")
    parser.add_argument("--model", help="the model's folder, for --engine sglang (dummy weights)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"),
                        help="each prompt's length, drawn evenly between these (random token ids; default 128)")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request (default 2)")
    parser.add_argument("--server-url", help="SGLang's own server: pair each request with the same prompt sent there")
    parser.add_argument("--gateway-port", type=int, default=0,
                        help="also start a gateway on this port and send every other pair of requests through it")
    parser.add_argument("--pin", type=lambda text: [int(core) for core in text.split(",")],
                        help="cores to pin to once ready, comma-separated: two for the nats-server, then one each for "
                             "the processor, the decode worker (every thread of its process; SGLang's scheduler and "
                             "detokenizer processes stay free), the gateway, this client")
    parser.add_argument("--gap-s", type=float, default=0.02, help="idle time between requests (default 0.02)")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts (default 0)")
    parser.add_argument("--load-streams", type=int, default=0,
                        help="other streams kept running through the pipeline meanwhile (default 0: idle)")
    parser.add_argument("--load-tokens", type=int, default=256, help="tokens of each load request (default 256)")
    parser.add_argument("--json-out", type=Path, help="also write each request's stamps and first tokens here")
    parser.add_argument("--start-timeout-s", type=float, default=600,
                        help="how long the workers may take to be ready (default 600)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose workers run (default: this one)")
    parser.add_argument("--keep-warm-ms", type=float, default=0.0,
                        help="wake the workers' and the client's event loops every this many ms while idle "
                             "(default 0: never; an experiment, see above)")
    parser.add_argument("--as-worker", choices=[*STAGES, "gateway"], help=argparse.SUPPRESS)
    parser.add_argument("--trace-file", help=argparse.SUPPRESS)
    parser.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_worker:
        sys.path.insert(0, str(args.root))
        run_traced_worker(args.as_worker, args.engine, args.trace_file, args.worker_args, args.keep_warm_ms)
        return
    if args.engine == "sglang" and not args.model:
        parser.error("--engine sglang needs --model")
    if args.load_streams and args.server_url:
        # The load runs through Conveyor only: pairing its first tokens with an idle server's would not compare.
        parser.error("--load-streams loads only Conveyor's pipeline: it cannot be paired with --server-url")
    import uvloop

    with tempfile.TemporaryDirectory(prefix="trace-hops-") as folder:
        client_points, gateway_points, gateway_s, server_s = uvloop.run(drive(args, Path(folder)))
        by_request = assemble(client_points, Path(folder))
        through_gateway = assemble(gateway_points, Path(folder), via_gateway=True)
    report(by_request, args.engine, gateway_s, server_s, args.load_streams, through_gateway)
    if args.json_out:
        args.json_out.write_text(json.dumps({"nats": by_request, "gateway": through_gateway, "gateway_s": gateway_s,
                                             "server_s": server_s}))


if __name__ == "__main__":
    main()
