"""Tokens per second into one receiving process: many reply streams from many sender processes, zero loss.

A gateway (or any client) reads every stream its users opened through one NATS connection, so the rate one
process can take in bounds how many decode workers one gateway can front. This starts an embedded nats-server,
one receiver (this process: `--streams` `ReplyStream`s on one connection and one subscription, as `PipelineClient`
holds them) and
`--senders` sender processes, each streaming its share of the streams with `ReplySender` in engine-like steps:
each step, every stream sends one frame of `--tokens-per-frame` tokens (1 = one token per engine step, as
SGLang streams; more = a sender coalescing), the steps paced so that all streams together offer `--offered-tok-s`. Each stream ends with its final frame, whose usage says how many
tokens were sent; the receiver checks every stream got exactly those, in order (ReplyStream checks the
sequence). Every process runs on the event loop the workers and gateway run on (uvloop; CONVEYOR_EVENT_LOOP=asyncio
for plain asyncio). Side by side in the same run: the same frames read by a bare nats-py subscription counting messages
(the floor of one process), so the ratio shows what the typed reply stream costs.

    .venv/bin/python scripts/bench_fanin.py                                # 4 senders, 512 streams, 250k tok/s
    .venv/bin/python scripts/bench_fanin.py --senders 8 --streams 1024 --tokens-per-frame 1 2 4 8

The senders pace themselves to the offered rate, so a received rate below it means the receiver (or the bus)
fell behind, and the run says how far; lost tokens and short streams are counted, and must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bus.connection import connect  # noqa: E402
from bus.errors import ReplyGap, ReplyStreamBroken  # noqa: E402
from bus.replies import ReplyInboxes, ReplySender, ReplyStream  # noqa: E402
from bus.server import EmbeddedNatsServer  # noqa: E402
from bus.settings import NatsSettings  # noqa: E402
from schemas.replies import FinalFrame, FinishReason, Usage  # noqa: E402
from workers.cli import run_loop  # noqa: E402

TOKEN_TEXT = " token"


def say(message: str) -> None:
    print(f"[bench-fanin {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def inbox_of(prefix: str, sender: int, stream: int) -> str:
    return f"_INBOX.{prefix}.{sender}_{stream}"


# ---- sender process -------------------------------------------------------------------------------------------

async def send(args: argparse.Namespace) -> None:
    nc = await connect(NatsSettings(urls=[args.nats]), f"fanin-sender-{args.sender}")
    senders = [ReplySender(nc, inbox_of(args.prefix, args.sender, stream), f"r{args.sender}-{stream}")
               for stream in range(args.streams)]
    token_ids = list(range(args.tokens_per_frame))
    step_s = args.step_s
    started_s = time.perf_counter()
    for step in range(args.steps):
        for sender in senders:
            await sender.send_tokens(token_ids, text=TOKEN_TEXT * args.tokens_per_frame)
        # Paced to the schedule, not to the last step: a late step is followed by an early one.
        delay_s = started_s + (step + 1) * step_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        elif step % 64 == 0:
            await asyncio.sleep(0)
    usage = Usage.of(1, args.steps * args.tokens_per_frame)
    for sender in senders:
        await sender.finish(FinishReason.LENGTH, usage)
    await nc.flush()
    lag_s = time.perf_counter() - started_s - args.steps * step_s
    print(f"sender {args.sender}: {args.steps} steps, {lag_s * 1000:.0f} ms behind schedule", flush=True)
    await nc.close()


# ---- receiver (this process) ----------------------------------------------------------------------------------

@dataclass
class Received:
    tokens: int
    frames: int
    seconds: float
    lost: int
    streams_short: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def spawn_senders(args: argparse.Namespace, url: str, prefix: str) -> list[subprocess.Popen[bytes]]:
    per_sender = args.streams // args.senders
    return [subprocess.Popen([sys.executable, __file__, "send", "--nats", url, "--prefix", prefix, "--sender",
                              str(index), "--streams", str(per_sender), "--steps", str(args.steps), "--step-s",
                              str(args.step_s), "--tokens-per-frame", str(args.frame_tokens)], cwd=ROOT)
            for index in range(args.senders)]


async def receive_typed(args: argparse.Namespace, url: str) -> Received:
    """Every stream read by a `ReplyStream` (decode, order and gap checks), as a client reads them: through one
    shared subscription, as `PipelineClient` does (`ReplyInboxes`), or with `--own-subscriptions` two per stream."""
    nc = await connect(NatsSettings(urls=[url]), "fanin-receiver")
    prefix = f"t{time.monotonic_ns()}"
    per_sender = args.streams // args.senders
    inboxes = None if args.own_subscriptions else ReplyInboxes(nc, prefix=f"_INBOX.{prefix}")
    streams = [ReplyStream(nc, inbox_of(prefix, sender, stream), f"r{sender}-{stream}",
                           heartbeat_timeout_s=10, first_frame_timeout_s=60, inboxes=inboxes)
               for sender in range(args.senders) for stream in range(per_sender)]
    for stream in streams:
        await stream.__aenter__()
    await nc.flush()
    first_s: list[float] = []
    counts = {"tokens": 0, "frames": 0, "short": 0}

    async def read(stream: ReplyStream) -> None:
        tokens = 0
        try:
            async for chunk in stream:
                if not first_s:
                    first_s.append(time.perf_counter())
                tokens += len(chunk.token_ids)
                counts["frames"] += 1
        except (ReplyGap, ReplyStreamBroken):
            # Frames were dropped (a slow consumer: the receiver fell behind the offered rate).
            counts["tokens"] += tokens
            counts["short"] += 1
            return
        assert isinstance(stream.terminal, FinalFrame)
        counts["tokens"] += tokens
        counts["short"] += tokens != stream.terminal.usage.completion_tokens

    processes = spawn_senders(args, url, prefix)
    await asyncio.gather(*(read(stream) for stream in streams))
    seconds = time.perf_counter() - first_s[0]
    for process in processes:
        process.wait(timeout=60)
    await nc.close()
    expected = args.streams // args.senders * args.senders * args.steps * args.frame_tokens
    return Received(counts["tokens"], counts["frames"], seconds, expected - counts["tokens"], counts["short"])


async def receive_raw(args: argparse.Namespace, url: str) -> Received:
    """The same frames counted by one wildcard nats-py subscription: no decoding, no per-stream state."""
    nc = await connect(NatsSettings(urls=[url]), "fanin-raw-receiver")
    prefix = f"r{time.monotonic_ns()}"
    per_sender = args.streams // args.senders
    expected_frames = per_sender * args.senders * (args.steps + 1)  # + the final frames
    first_s: list[float] = []
    frames = [0]
    done = asyncio.Event()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        if not first_s:
            first_s.append(time.perf_counter())
        frames[0] += 1
        if frames[0] == expected_frames:
            done.set()

    subscription = await nc.subscribe(f"_INBOX.{prefix}.>", cb=on_msg, pending_msgs_limit=10_000_000,
                                      pending_bytes_limit=4 << 30)
    await nc.flush()
    processes = spawn_senders(args, url, prefix)
    for process in processes:
        await asyncio.to_thread(process.wait, 600)
    try:
        await asyncio.wait_for(done.wait(), timeout=60)
    except TimeoutError:
        pass  # reported as lost
    seconds = time.perf_counter() - first_s[0]
    await subscription.unsubscribe()
    await nc.close()
    token_frames = max(0, frames[0] - per_sender * args.senders)
    expected_tokens = per_sender * args.senders * args.steps * args.frame_tokens
    return Received(token_frames * args.frame_tokens, frames[0], seconds,
                    expected_tokens - token_frames * args.frame_tokens, 0)


def row(label: str, result: Received, offered: float) -> str:
    return (f"  {label:<24} {result.tokens_per_s:>10,.0f} tok/s ({result.tokens_per_s / offered:.2f}× offered)  "
            f"{result.frames / result.seconds:>9,.0f} frames/s  lost {result.lost:,}  short streams {result.streams_short}")


async def main(args: argparse.Namespace) -> None:
    with EmbeddedNatsServer() as server:
        num_streams = args.streams // args.senders * args.senders
        say(f"nats-server {server.url}; {args.senders} sender processes, {num_streams} streams, "
            f"{args.offered_tok_s:,.0f} tok/s offered for {args.seconds:g} s")
        for frame_tokens in args.tokens_per_frame:
            args.frame_tokens = frame_tokens
            args.step_s = num_streams * frame_tokens / args.offered_tok_s
            args.steps = max(1, round(args.seconds / args.step_s))
            offered = num_streams * frame_tokens / args.step_s
            runs: dict[str, list[Received]] = {"typed": [], "raw": []}
            for round_index in range(args.rounds):
                order = ["typed", "raw"] if round_index % 2 == 0 else ["raw", "typed"]
                order = [kind for kind in order if args.only in (None, kind)]
                for kind in order:
                    result = await (receive_typed if kind == "typed" else receive_raw)(args, server.url)
                    say(f"{frame_tokens} token(s)/frame, round {round_index + 1}, {kind}: "
                        f"{result.tokens_per_s:,.0f} tok/s, lost {result.lost}")
                    runs[kind].append(result)
            if args.only is not None:
                for result in runs[args.only]:
                    print(row(f"{args.only}, {frame_tokens} token(s)/frame", result, offered))
                continue
            typed = sorted(runs["typed"], key=lambda r: r.tokens_per_s)[len(runs["typed"]) // 2]
            raw = sorted(runs["raw"], key=lambda r: r.tokens_per_s)[len(runs["raw"]) // 2]
            print(f"\n{frame_tokens} token(s) per frame (a frame per stream every {args.step_s * 1000:.1f} ms), "
                  f"offered {offered:,.0f} tok/s; median of {args.rounds} rounds")
            print(row("conveyor ReplyStream", typed, offered))
            print(row("raw nats-py (floor)", raw, offered))
            print(f"  ratio conveyor ÷ raw: {typed.tokens_per_s / raw.tokens_per_s:.2f}×; "
                  f"rounds: {', '.join(f'{r.tokens_per_s:,.0f}' for r in runs['typed'])} / "
                  f"{', '.join(f'{r.tokens_per_s:,.0f}' for r in runs['raw'])}; "
                  f"spread {statistics.pstdev(r.tokens_per_s for r in runs['typed']) / typed.tokens_per_s:.0%}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=["bench", "send"], default="bench")
    parser.add_argument("--senders", type=int, default=4, help="sender processes (each a decode worker's stand-in)")
    parser.add_argument("--streams", type=int, default=512, help="streams in all, split across the senders")
    parser.add_argument("--offered-tok-s", type=float, default=250_000, help="tokens/s all streams offer together")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument("--tokens-per-frame", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (typed, raw; raw, typed; ...)")
    parser.add_argument("--only", choices=["typed", "raw"], help="run one receiver only, every round listed")
    parser.add_argument("--own-subscriptions", action="store_true",
                        help="the typed receiver subscribes twice per stream (before the twenty-fifth stop, every "
                             "client did), instead of reading all streams through one subscription")
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--sender", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.mode == "send":
        parsed.tokens_per_frame = parsed.tokens_per_frame[0]
        run_loop(send(parsed))
    else:
        run_loop(main(parsed))
