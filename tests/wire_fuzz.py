"""Mutated client requests for the processor subject, and a check that every one was answered or
terminated with a reason. Used by tests/test_fuzz.py (a few thousand, in CI) and scripts/fuzz_wire.py
(10^5 and more).

A payload starts from a valid chat, completion or embedding request and gets one to three mutations:
a field dropped, set to a hostile value (huge numbers, NaN, long or odd strings, deep nesting, bytes,
wrong types), an unknown field added, a nested value replaced, a wrong `kind`; or, at the byte level,
truncated, bit-flipped, padded with garbage or replaced by random bytes. Each is published with
a `Conveyor-Fuzz: {i}` header and, where the mutation left it, reply inbox `{prefix}.{i}`, so its fate can be
traced: a terminal frame on its inbox, or a dead letter carrying its headers.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from pydantic import TypeAdapter, ValidationError

from bus.subjects import Names
from schemas.client import Inbox
from schemas.codec import unpack
from schemas.registry import Stage
from workers.engines.factory import EngineKind
from workers.processor import ProcessorStage
from workers.stages import served_model


_INBOX: TypeAdapter[str] = TypeAdapter(Inbox)
# Kept by dead letters (unlike Nats-Msg-Id): which payload a dead letter was.
_INDEX_HEADER = "Conveyor-Fuzz"


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE: list[Any] = [
    None, True, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e308, -1e308, float("inf"), float("-inf"),
    float("nan"), 0.5, "", " ", "x" * 10_000, "\x00\ud7ff\u202e", "../../etc/passwd", "file:///etc/shadow",
    "http://127.0.0.1:1/", "data:image/png;base64,AAAA", [], {}, [1] * 1000, [-5, 2**40], ["a"] * 300,
    b"\x00\xff\xfe", {"type": "image_url"}, {"role": "user"}, _deep(60), {"a": _deep(30)}, [None],
    [{"type": "text", "text": "hi"}] * 50, [{"type": "image_url", "image_url": {"url": "data:,"}}],
]


def _valid(index: int, inbox_prefix: str, model: str) -> dict[str, Any]:
    base = {"request_id": f"fuzz-{index}", "reply_to": f"{inbox_prefix}.{index}", "model": model}
    shape = index % 5
    if shape == 0:
        return {**base, "kind": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    if shape == 1:
        return {**base, "kind": "chat", "max_tokens": 3, "stop": ["."], "temperature": 0.7, "seed": 7,
                "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    if shape == 2:
        return {**base, "kind": "completion", "prompt": "once upon a time", "max_tokens": 2, "logprobs": True}
    if shape == 3:
        return {**base, "kind": "completion", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "n": 1}
    return {**base, "kind": "embedding", "input": ["a", "b"]}


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if len(prefix) >= 6:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for position, item in enumerate(value[:4]):
            yield from _paths(item, (*prefix, position))


def _set(root: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return root


def _hostile(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(HOSTILE))  # a copy: later mutations must not change the pool


def _mutate(payload: dict[str, Any], rng: random.Random) -> Any:
    value: Any = copy.deepcopy(payload)
    for _ in range(rng.randint(1, 3)):
        if not isinstance(value, dict):
            break
        operator = rng.randrange(5)
        if operator == 0 and value:
            value.pop(rng.choice(list(value)))
        elif operator == 1:
            value[rng.choice(list(value) or ["x"])] = _hostile(rng)
        elif operator == 2:
            value[rng.choice(["temprature", "extra", "__proto__", "kind2", "x" * 300])] = _hostile(rng)
        elif operator == 3:
            value = _set(value, rng.choice(list(_paths(value))), _hostile(rng))
        else:
            value["kind"] = rng.choice(["chat", "completion", "embedding", "CHAT", "", None, 3])
    return value


def _packed(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (ValueError, TypeError, OverflowError):
        return msgpack.packb({"unpackable": True}, use_bin_type=True)


def _byte_mutation(data: bytes, rng: random.Random) -> bytes:
    operator = rng.randrange(4)
    if operator == 0:
        return data[: rng.randrange(len(data))]
    if operator == 1:
        flipped = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    if operator == 2:
        return data + rng.randbytes(rng.randint(1, 64))
    return rng.randbytes(rng.randint(0, 256))


def payloads(count: int, inbox_prefix: str, model: str, seed: int = 0) -> Iterator[tuple[int, bytes, bool]]:
    """`count` mutated requests: (index, msgpack bytes, traceable). Untraceable: a mutation pointed its
    answer at another valid subject, where nobody here sees it; every other payload must come back as an
    answer on its inbox or as a dead letter."""
    rng = random.Random(seed)
    for index in range(count):
        valid = _valid(index, inbox_prefix, model)
        if rng.random() < 0.2:
            data = _byte_mutation(_packed(valid), rng)
        else:
            data = _packed(_mutate(valid, rng))
        yield index, data, _traceable(data, valid)


def _traceable(data: bytes, valid: dict[str, Any]) -> bool:
    try:
        decoded = unpack(data)
    except Exception:
        return True
    if not isinstance(decoded, dict) or decoded.get("reply_to") == valid["reply_to"]:
        return True
    # Another inbox that is still a valid one gets the answer; an invalid one means a dead letter.
    try:
        _INBOX.validate_python(decoded.get("reply_to"))
    except ValidationError:
        return True
    return False


def fuzzing_processor(model: str = "mock") -> ProcessorStage:
    """A mock-model processor with a short context: a mutation that asks for millions of tokens gets at
    most a couple of hundred, so a run of 10^5 payloads is spent on parsing, not on generating."""
    served = replace(served_model(EngineKind.MOCK, model), context_length=256)
    return ProcessorStage({model: served})


@dataclass
class FuzzReport:
    sent: int = 0
    # Payloads whose answer can be seen here (see `payloads`); the others are only counted.
    traceable: set[int] = field(default_factory=set)
    answered: set[int] = field(default_factory=set)
    dead_lettered: set[int] = field(default_factory=set)
    elapsed_s: float = 0.0

    @property
    def unaccounted(self) -> set[int]:
        return self.traceable - self.answered - self.dead_lettered


async def fuzz_processor(nc: Client, js: JetStreamContext, names: Names, count: int, model: str,
                         seed: int = 0, settle_timeout_s: float = 120.0,
                         progress: Callable[[FuzzReport], None] | None = None) -> FuzzReport:
    """Publish `count` mutated requests to the processor subject; wait until each is answered (a
    terminal frame on its inbox) or dead-lettered (terminated with a reason)."""
    prefix = f"_INBOX.fuzz{random.Random(seed).getrandbits(32):08x}"
    report = FuzzReport()

    async def on_frame(msg: Msg) -> None:
        try:
            frame = unpack(msg.data)
        except Exception:
            return
        if isinstance(frame, dict) and frame.get("kind") in ("final", "error", "embedding"):
            suffix = msg.subject.rsplit(".", 1)[1]
            if suffix.isdigit():
                report.answered.add(int(suffix))

    async def on_dead_letter(msg: Msg) -> None:
        index = (msg.headers or {}).get(_INDEX_HEADER)
        if index is not None and index.startswith(prefix):
            report.dead_lettered.add(int(index.rsplit(".", 1)[1]))

    subscription = await nc.subscribe(f"{prefix}.*", cb=on_frame, pending_msgs_limit=-1, pending_bytes_limit=-1)
    dead_letters = await js.subscribe(names.dead_letter_subject(Stage.PROCESSOR.value), cb=on_dead_letter,
                                      ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
    started_s = time.monotonic()
    subject = names.work_subject(Stage.PROCESSOR)
    try:
        for index, data, traceable in payloads(count, prefix, model, seed):
            await js.publish(subject, data, headers={_INDEX_HEADER: f"{prefix}.{index}"})
            report.sent += 1
            if traceable:
                report.traceable.add(index)
            if progress is not None and report.sent % 10_000 == 0:
                progress(report)
        deadline = time.monotonic() + settle_timeout_s
        while report.unaccounted and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        await subscription.unsubscribe()
        await dead_letters.unsubscribe()
    report.elapsed_s = time.monotonic() - started_s
    return report
