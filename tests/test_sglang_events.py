"""The inline KV-event publisher that runs in SGLang's scheduler processes: its frames reach our relay as SGLang's own
publisher's do, in order, on each data-parallel rank's endpoint; the engine arguments name it only when asked."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

from bus.server import free_port
from schemas.kv_hashing import chain_hashes
from workers.engines.sglang_engine import KvEventRelay, SGLangEngineConfig, server_args
from workers.engines.sglang_events import (
    PUBLISHER_NAME,
    InlineKvEventPublisher,
    binds,
    inline_publisher_engine,
    offset_endpoint,
    run_scheduler_with_inline_publisher,
)


@dataclass
class Batch:
    """Shaped as SGLang's `KVEventBatch` (msgspec, array_like: `[ts, events, attn_dp_rank]`)."""

    ts: float
    events: list[Any] = field(default_factory=list)
    attn_dp_rank: int | None = None


def encode_as_sglang(batch: Batch) -> bytes:
    return msgpack.packb([batch.ts, batch.events, batch.attn_dp_rank])


def stored(tokens: list[int], engine_hash: int) -> list[Any]:
    return ["BlockStored", [engine_hash], None, tokens, len(tokens), None, None]


async def _collect_after_subscribed(publisher: InlineKvEventPublisher, relay: KvEventRelay,
                                    batches: list[Batch]) -> list[Any]:
    """Publish probes until the relay hears one (ZMQ's slow joiner), then `batches`; what the relay passed on."""
    received: list[Any] = []

    async def collect() -> None:
        async for batch in relay.batches.listen():
            received.append(batch)

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0)
    for attempt in range(100):
        publisher.publish(Batch(ts=float(attempt), events=[stored([7] * 16, 1)]))
        await asyncio.sleep(0.05)
        if received:
            break
    heard_probes = len(received)
    for batch in batches:
        publisher.publish(batch)
    for _ in range(100):
        if len(received) >= heard_probes + len(batches):
            break
        await asyncio.sleep(0.02)
    collector.cancel()
    return received[heard_probes:]


async def test_the_inline_publisher_reaches_the_relay_in_order_with_no_gap(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    publisher = InlineKvEventPublisher(endpoint=endpoint, topic="kv-events", encode=encode_as_sglang)
    relay = KvEventRelay(endpoint)
    await relay.start()
    try:
        batches = [Batch(ts=100.0 + n, events=[stored([n] * 16, 10 + n)]) for n in range(3)]
        received = await _collect_after_subscribed(publisher, relay, batches)
        assert [b.events[0].block_hashes for b in received] == [chain_hashes([n] * 16, 16) for n in range(3)]
        assert [b.ts for b in received] == [100.0, 101.0, 102.0]
        assert relay.gaps == 0 and relay.last_seq == publisher.next_seq - 1
    finally:
        await relay.stop()
        publisher.shutdown()


async def test_a_data_parallel_rank_publishes_on_its_own_port_and_marks_its_batches() -> None:
    port = free_port()
    publisher = InlineKvEventPublisher(attn_dp_rank=1, endpoint=f"tcp://*:{port - 1}", encode=encode_as_sglang)
    assert publisher.endpoint == f"tcp://*:{port}"
    relay = KvEventRelay(f"tcp://127.0.0.1:{port}")
    await relay.start()
    try:
        received = await _collect_after_subscribed(publisher, relay, [Batch(ts=5.0, events=[stored([3] * 16, 2)])])
        assert [b.data_parallel_rank for b in received] == [1]
    finally:
        await relay.stop()
        publisher.shutdown()


def test_endpoints_are_offset_and_bound_by_sglangs_rules() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///run/kv", 0) == "ipc:///run/kv"
    with pytest.raises(ValueError, match="tcp://"):
        offset_endpoint("ipc:///run/kv", 1)
    assert binds("ipc:///run/kv") and binds("tcp://*:5557") and binds("tcp://0.0.0.0:5557")
    assert not binds("tcp://10.0.0.2:5557")


def test_a_replay_socket_is_refused_with_the_setting_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replay_endpoint"):
        InlineKvEventPublisher(endpoint=f"ipc://{tmp_path}/kv", replay_endpoint=f"ipc://{tmp_path}/replay",
                               encode=encode_as_sglang)


def test_sglangs_config_fields_build_the_publisher(tmp_path: Path) -> None:
    # SGLang's factory passes every KVEventsConfig field but `publisher`, with the rank.
    fields = {"endpoint": f"ipc://{tmp_path}/kv", "replay_endpoint": None, "buffer_steps": 10_000, "hwm": 100_000,
              "max_queue_size": 100_000, "topic": "kv-events"}
    publisher = InlineKvEventPublisher(attn_dp_rank=0, **fields, encode=encode_as_sglang)
    publisher.shutdown()
    assert publisher.endpoint == fields["endpoint"]


@pytest.mark.parametrize(("setting", "publisher"), [("sglang", "zmq"), ("inline", PUBLISHER_NAME)])
def test_the_engine_arguments_name_the_publisher_asked_for(setting: str, publisher: str) -> None:
    config = SGLangEngineConfig(model_path="m", kv_events_publisher=setting)
    events = json.loads(server_args(config, "ipc:///run/kv", bootstrap_port=1)["kv_events_config"])
    assert events == {"publisher": publisher, "endpoint": "ipc:///run/kv", "topic": "kv-events"}


def test_the_inline_publisher_is_the_default() -> None:
    assert SGLangEngineConfig(model_path="m").kv_events_publisher == "inline"


def _sglang_engine_module(monkeypatch: pytest.MonkeyPatch, engine: type) -> None:
    """`sglang.srt.entrypoints.engine` holding `engine`: the CPU install has no SGLang, and only its Engine class is
    read here."""
    names = ["sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].Engine = engine  # type: ignore[attr-defined]


def test_the_engine_starts_its_schedulers_with_the_publisher_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    class Engine:
        run_scheduler_process_func = staticmethod(lambda: None)

    _sglang_engine_module(monkeypatch, Engine)
    engine = inline_publisher_engine()
    assert issubclass(engine, Engine)
    assert engine.run_scheduler_process_func is run_scheduler_with_inline_publisher


def test_an_sglang_without_the_scheduler_hook_is_refused_with_the_setting_to_change(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _sglang_engine_module(monkeypatch, type("Engine", (), {}))
    with pytest.raises(RuntimeError, match="CONVEYOR_SGLANG_KV_EVENTS_PUBLISHER=sglang"):
        inline_publisher_engine()
