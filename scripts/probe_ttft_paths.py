"""Where a loaded stack's first token waits: the gateway, or the bus behind it.

While another client loads a running Conveyor stack (e.g. `scripts/bench_aiperf.py`), this sends one short chat
request at a time, alternating between two paths, and prints each one's time to first token as it goes:
- **http**: through the gateway (`/v1/chat/completions`, streaming, a fresh connection per request);
- **nats**: straight onto the bus (a `ChatRequest` published to the processor's stream, as any NATS client does).

If both paths slow down together under load, the wait is behind the gateway (processor, decode worker, engine); if
only the first does, it is the gateway.

    bash scripts/gpu_run.sh python3 scripts/probe_ttft_paths.py --namespace NS --model .gpu/smol --duration 40

NS is the stack's namespace (CONVEYOR_NAMESPACE in its workers' environment).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus.client import PipelineClient, open_client  # noqa: E402
from bus.settings import BusSettings, NatsSettings  # noqa: E402
from schemas.client import ChatMessage, ChatRequest, StreamFormat  # noqa: E402

PROMPT = "hello"
MAX_TOKENS = 2


async def ttft_over_http(gateway_url: str, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "stream": True}
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.post(f"{gateway_url}/v1/chat/completions",
                                                                json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data:"):
                break
    return (time.perf_counter() - started) * 1000


async def ttft_over_nats(client: PipelineClient, model: str) -> float:
    request = ChatRequest(request_id=f"probe-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(), model=model,
                          messages=[ChatMessage(role="user", content=PROMPT)], max_tokens=MAX_TOKENS,
                          stream_format=StreamFormat.OPENAI)
    started = time.perf_counter()
    async with await client.submit(request, first_frame_timeout_s=60) as stream:
        async for _ in stream:
            break
    return (time.perf_counter() - started) * 1000


async def probe(args: argparse.Namespace) -> None:
    samples: dict[str, list[float]] = {"http": [], "nats": []}
    async with open_client(NatsSettings(urls=[args.nats]), BusSettings(namespace=args.namespace), "probe") as client:
        started = time.monotonic()
        while time.monotonic() - started < args.duration_s:
            over_http = await ttft_over_http(args.gateway, args.model)
            over_nats = await ttft_over_nats(client, args.model)
            samples["http"].append(over_http)
            samples["nats"].append(over_nats)
            print(f"{time.monotonic() - started:6.2f} s  http {over_http:7.1f} ms  nats {over_nats:7.1f} ms", flush=True)
            await asyncio.sleep(args.interval_s)
    for path, values in samples.items():
        values.sort()
        print(f"{path}: {len(values)} requests, TTFT p50 {statistics.median(values):.1f} ms, "
              f"p90 {values[int(0.9 * len(values))]:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://127.0.0.1:8000", help="the stack's OpenAI API root")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="the stack's NATS server")
    parser.add_argument("--namespace", required=True, help="the stack's namespace (its workers' CONVEYOR_NAMESPACE)")
    parser.add_argument("--model", required=True, help="the model name the stack serves")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--interval-s", type=float, default=0.2, help="pause between two pairs of requests")
    asyncio.run(probe(parser.parse_args()))


if __name__ == "__main__":
    main()
