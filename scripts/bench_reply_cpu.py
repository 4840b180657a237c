"""CPU per token of the reply path alone: `ReplySender` frames for many streams, as a decode worker sends them.

Each run opens --streams senders on one embedded nats-server, then sends --tokens engine steps, each one token per
stream followed by a turn of the event loop (as SGLang's outputs arrive), and reports this process's CPU time per
token. Three kinds of frame: token ids; token ids with the reply journal; OpenAI chat chunks with the journal (what
the gateway asks for). It prints the minimum over --runs for each. `--repo` imports Conveyor from another checkout
(a worktree of the commit before a change), so running it once per checkout compares the two:

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/bench_reply_cpu.py && .venv/bin/python scripts/bench_reply_cpu.py --repo /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

KINDS = {"token ids": (False, False), "token ids, journaled": (True, False), "chat chunks, journaled": (True, True)}


async def run_once(args: argparse.Namespace, url: str, journaled: bool, chat: bool) -> float:
    """Microseconds of CPU per token for one run of every stream."""
    import nats

    from bus.journal import ReplyJournal
    from bus.replies import ReplySender
    from schemas.replies import ChatChunkDelta

    nc = await nats.connect(url)
    await nc.subscribe("bench.inbox.>", cb=None, pending_msgs_limit=-1, pending_bytes_limit=-1)
    senders = [ReplySender(nc, f"bench.inbox.{index}", f"r{index}",
                           journal=ReplyJournal(nc, f"bench.progress.r{index}", f"r{index}") if journaled else None)
               for index in range(args.streams)]
    started_s = time.process_time()
    for token in range(args.tokens):
        for index, sender in enumerate(senders):
            delta = ChatChunkDelta(id=f"r{index}", created=1, model="m", content="tok") if chat else None
            await sender.send_tokens([token], text="tok", openai=delta)
        await asyncio.sleep(0)  # the next engine step arrives on a later turn of the loop
    cpu_s = time.process_time() - started_s
    await nc.close()
    return 1e6 * cpu_s / (args.streams * args.tokens)


async def main(args: argparse.Namespace) -> None:
    from bus.server import EmbeddedNatsServer

    server = EmbeddedNatsServer()
    url = server.start()
    try:
        import nats

        nc = await nats.connect(url)
        await nc.jetstream().add_stream(name="BENCH_PROGRESS", subjects=["bench.progress.>"], storage="memory")
        await nc.close()
        results: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.runs):
            for kind, (journaled, chat) in KINDS.items():
                results[kind].append(await run_once(args, url, journaled, chat))
    finally:
        server.stop()
    print(f"reply path, {args.streams} streams x {args.tokens} tokens, checkout {args.repo}: CPU per token, "
          f"min of {args.runs} runs")
    for kind, values in results.items():
        print(f"  {kind:24s} {min(values):6.2f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=320, help="tokens per stream (one engine step each)")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose Conveyor is measured")
    arguments = parser.parse_args()
    sys.path.insert(0, str(arguments.repo))
    import uvloop

    uvloop.run(main(arguments))
