"""Fuzz the processor subject: publish mutated client requests (tests/wire_fuzz.py says how they are made)
at a processor and a decode worker (mock engine) on an embedded nats-server, then report how many were
answered, how many terminated with a reason (dead-lettered), how many neither, and whether a worker died.

    .venv/bin/python scripts/fuzz_wire.py                 # 100 000 payloads
    .venv/bin/python scripts/fuzz_wire.py --count 10000 --seed 3 --show 5
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import structlog

from bus.connection import connect
from bus.server import EmbeddedNatsServer
from bus.settings import BusSettings, NatsSettings
from bus.streams import declare_all
from bus.subjects import Names
from schemas.registry import ServingMode, Stage
from tests.wire_fuzz import fuzz_processor, fuzzing_processor, payloads
from workers.runtime import WorkerOptions, WorkerRuntime
from tests.pipeline_helpers import MOCK, mock_decode


async def main(args: argparse.Namespace) -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if "-v" in sys.argv else logging.ERROR))
    with EmbeddedNatsServer() as server:
        nats = NatsSettings(urls=[server.url])
        bus = BusSettings(namespace=f"fuzz{uuid.uuid4().hex[:6]}", max_deliver=2, retry_base_s=0.05, retry_max_s=0.1,
                          work_max_msgs=10_000_000, work_max_bytes=1 << 30)
        nc = await connect(nats, name="fuzz")
        js = nc.jetstream()
        names = Names(bus.namespace)
        await declare_all(js, names, bus, nc.max_payload)
        runtimes = []
        for stage, built in [(Stage.PROCESSOR, fuzzing_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.0))]:
            options = WorkerOptions(stage=stage, model=MOCK, mode=ServingMode.AGGREGATED, engine_name="mock",
                                    http_host="127.0.0.1", max_concurrency=64, handle_signals=False)
            runtime = WorkerRuntime(built, options, nats, bus)
            runtimes.append((runtime, asyncio.create_task(runtime.run())))
            await runtime.started.wait()
        print(f"[fuzz] publishing {args.count} mutated requests (seed {args.seed})", file=sys.stderr, flush=True)
        report = await fuzz_processor(
            nc, js, names, args.count, MOCK, seed=args.seed, settle_timeout_s=args.settle_s,
            progress=lambda r: print(f"[fuzz] {r.sent} sent, {len(r.answered)} answered, {len(r.dead_lettered)} "
                                     f"terminated", file=sys.stderr, flush=True))
        died = [runtime.options.stage.value for runtime, task in runtimes if task.done()]
        for runtime, _ in runtimes:
            runtime.request_stop()
        await asyncio.gather(*(task for _, task in runtimes), return_exceptions=True)
        await nc.close()
    print(f"sent {report.sent} in {report.elapsed_s:.1f} s ({report.sent / report.elapsed_s:.0f}/s): "
          f"{len(report.answered)} answered, {len(report.dead_lettered)} terminated with a reason, "
          f"{len(report.unaccounted)} of the {len(report.traceable)} traceable neither "
          f"({report.sent - len(report.traceable)} answered to a subject a mutation chose); "
          f"workers died: {', '.join(died) or 'none'}")
    if report.unaccounted and args.show:
        wanted = set(sorted(report.unaccounted)[: args.show])
        for index, data, _ in payloads(args.count, "_INBOX.x", MOCK, args.seed):
            if index in wanted:
                print(f"  #{index}: {data[:300]!r}")
    return 1 if report.unaccounted or died else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=300.0, help="how long to wait for the last answers")
    parser.add_argument("--show", type=int, default=5, help="print this many unaccounted payloads")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
