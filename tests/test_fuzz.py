"""Fuzzing the processor subject: mutated requests never crash a worker, and every one is answered
(an error frame, or a streamed answer when the mutation left it valid) or terminated with a reason
(dead-lettered). The full run (10^5 and more) is scripts/fuzz_wire.py."""

from __future__ import annotations

import os

import pytest

from schemas.registry import Stage
from tests.conftest import Bus, bus_settings
from tests.pipeline_helpers import MOCK, chat, client_of, mock_decode, running_workers
from tests.wire_fuzz import fuzz_processor, fuzzing_processor

COUNT = int(os.environ.get("CONVEYOR_FUZZ_COUNT", "3000"))


@pytest.mark.parametrize("settings", [bus_settings(max_deliver=2, retry_base_s=0.05, retry_max_s=0.1)])
async def test_mutated_requests_are_each_answered_or_terminated_and_no_worker_dies(bus: Bus) -> None:
    async with running_workers(bus, [(Stage.PROCESSOR, fuzzing_processor()), (Stage.DECODE, mock_decode(inter_token_s=0.0))],
                               max_concurrency=64) as workers:
        report = await fuzz_processor(bus.nc, bus.js, bus.names, COUNT, MOCK, settle_timeout_s=120)
        assert not any(worker.task.done() for worker in workers), "a worker stopped"
        client = client_of(bus)
        async with await client.submit(chat(client, "still there?", max_tokens=3)) as stream:
            _, final = await stream.collect()
    assert report.sent == COUNT
    assert not report.unaccounted, f"{len(report.unaccounted)} payloads neither answered nor terminated, e.g. {sorted(report.unaccounted)[:10]}"
    assert report.answered and report.dead_lettered  # both fates occurred
    assert final.usage.completion_tokens == 3
