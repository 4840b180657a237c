"""Where one request's first token spends its time, hop by hop: client → processor → decode → client, one at a time.

It starts an embedded nats-server and a processor and a decode worker on the mock engine (5 ms to the first token) as
their own processes, with time stamps added at each point of a task's path by wrapping functions at start-up (nothing
in the project changes). Then it sends --requests token-id requests one after another, 20 ms apart (an idle pipeline:
what one stream sees), and prints the median time between consecutive points:

    client submits → publishes → task stored in the stream (JetStream's own timestamp) → on the worker's socket →
    handed to a handler task → the stage's handler starts → [processor] publishes the next task → ... →
    [decode] the engine starts → the engine's first token → the first frame published → the client has it

    .venv/bin/python scripts/trace_hops.py --requests 300
    .venv/bin/python scripts/trace_hops.py --requests 300 --root /tmp/base   # another checkout's workers

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
from collections.abc import Callable
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


# ----- in each worker process: wrap the path's functions, then run the worker ---------------------------------------

def run_traced_worker(stage: str, out_path: str, argv: list[str]) -> None:
    out = open(out_path, "w", buffering=1)  # noqa: SIM115 (open for the process's life)

    def stamp(point: str, request_id: str | None = None, at_s: float | None = None) -> None:
        out.write(json.dumps({"point": point, "request_id": request_id, "t": at_s or time.time()}) + "\n")

    _wrap_consumer(stage, stamp)
    _wrap_socket(stage, stamp)
    _wrap_publish(stamp)
    if stage == "decode":
        _wrap_engine_and_frames(stamp)
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


def _wrap_engine_and_frames(stamp: Callable[..., None]) -> None:
    from bus import connection, journal, replies
    from workers.engines import mock

    generate = mock.MockEngine.generate

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

    mock.MockEngine.generate = traced_generate  # type: ignore[method-assign]
    replies.publish_frames = journal.publish_frames = traced_publish_frames  # type: ignore[assignment]


# ----- the driver ----------------------------------------------------------------------------------------------------

async def drive(args: argparse.Namespace, trace_dir: Path) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(args.root))
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_pipeline import mock_env, wait_ready

    from bus.client import open_client
    from bus.server import EmbeddedNatsServer
    from bus.settings import BusSettings, NatsSettings
    from schemas.client import CompletionRequest, StreamFormat

    client_points: dict[str, dict[str, float]] = {}

    def stamp(point: str, request_id: str | None = None, at_s: float | None = None) -> None:
        if request_id is not None:
            client_points.setdefault(request_id, {})[point] = at_s or time.time()

    _wrap_publish(stamp)
    with EmbeddedNatsServer() as server:
        namespace = f"hops{uuid.uuid4().hex[:6]}"
        env = {**os.environ, **mock_env(inter_token_ms=10), "CONVEYOR_NATS_URLS": server.url,
               "CONVEYOR_NAMESPACE": namespace, "PYTHONPATH": str(args.root)}
        workers = [subprocess.Popen([sys.executable, __file__, "--as-worker", stage, "--trace-file",
                                     str(trace_dir / f"{stage}.jsonl"), "--root", str(args.root), "--",
                                     "--engine", "mock", "--log-level", "WARNING"], cwd=args.root, env=env)
                   for stage in STAGES]
        try:
            async with open_client(NatsSettings(urls=[server.url]), BusSettings(namespace=namespace), "hops") as client:
                await wait_ready(client)
                for index in range(args.warmup + args.requests):
                    request = CompletionRequest(request_id=f"hop{index:05d}-{uuid.uuid4().hex[:6]}",
                                                reply_to=client.new_inbox(), model="mock",
                                                prompt=list(range(1000, 1128)), max_tokens=2,
                                                stream_format=StreamFormat.TOKENS)
                    submitted_s, first_s = time.time(), 0.0
                    async with await client.submit(request, first_frame_timeout_s=30) as stream:
                        async for chunk in stream:
                            if not first_s and chunk.token_ids:
                                first_s = time.time()
                    if index >= args.warmup:
                        client_points[request.request_id].update(submit=submitted_s, client_first=first_s)
                    else:
                        client_points.pop(request.request_id, None)
                    await asyncio.sleep(0.02)
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
            for worker in workers:
                worker.wait(timeout=30)
    return client_points


def assemble(by_request: dict[str, dict[str, float]], trace_dir: Path) -> dict[str, dict[str, float]]:
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
        for point, stamped_as, after in (("processor.socket", "processor.socket", "processor.stored"),
                                         ("decode.socket", "decode.socket", "decode.stored"),
                                         ("first_frame_out", "frames_out", "engine.first_token")):
            found = _first_after(unnamed.get(stamped_as, []), points.get(after))
            if found is not None:
                points[point] = found
    return by_request


def _first_after(stamps: list[float], after: float | None) -> float | None:
    return None if after is None else next((t for t in stamps if t >= after), None)


def report(by_request: dict[str, dict[str, float]]) -> None:
    complete = [points for points in by_request.values() if all(point in points for point in POINTS)]
    print(f"{len(complete)} requests one at a time, medians in ms (mock engine: 5 ms to the first token)")
    total_ms = 0.0
    for before, point in pairwise(POINTS):
        step_ms = statistics.median(1000 * (points[point] - points[before]) for points in complete)
        total_ms += step_ms
        print(f"  → {point:<22} {step_ms:7.3f}   {total_ms:7.3f}")
    ttfts_ms = [1000 * (points["client_first"] - points["submit"]) for points in complete]
    print(f"first token: p50 {statistics.median(ttfts_ms):.2f} ms, p90 {sorted(ttfts_ms)[int(0.9 * len(ttfts_ms))]:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose workers run (default: this one)")
    parser.add_argument("--as-worker", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--trace-file", help=argparse.SUPPRESS)
    parser.add_argument("worker_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_worker:
        sys.path.insert(0, str(args.root))
        run_traced_worker(args.as_worker, args.trace_file, args.worker_args)
        return
    import uvloop

    with tempfile.TemporaryDirectory(prefix="trace-hops-") as folder:
        client_points = uvloop.run(drive(args, Path(folder)))
        report(assemble(client_points, Path(folder)))


if __name__ == "__main__":
    main()
