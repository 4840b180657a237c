"""SGLang's KV events sent from the scheduler's own thread, without SGLang's publisher thread.

Why: with SGLang's KV events on, the stack's SGLang kept 0.88x of its pace at 256 streams and 0.89x at 128 against
the same stack with them off (docs/performance.md, forty-ninth stop), where recording them measures ~1% of a
scheduler on a CPU. SGLang's own publisher (`ZmqEventPublisher`) queues each batch to a Python thread in the
scheduler's process, which takes the GIL from the scheduling loop to encode and send it. This publisher does that
work on the loop itself (a msgpack encode and a non-blocking ZMQ send, microseconds a batch), so no second Python
thread competes for the GIL. On four H200s at once (fiftieth stop), the stack with this publisher streamed 1.07-1.13x
the tokens of the stack with SGLang's at 256 streams and 1.06-1.11x at 16, so it is the default;
`CONVEYOR_SGLANG_KV_EVENTS_PUBLISHER=sglang` names SGLang's own again.

How it gets into the scheduler: `sglang.Engine` starts each scheduler process with its class attribute
`run_scheduler_process_func`, in a spawned process (so the function is imported there by name).
`inline_publisher_engine()` subclasses the Engine with `run_scheduler_with_inline_publisher`, which registers
`InlineKvEventPublisher` with SGLang's publisher factory under `PUBLISHER_NAME`, then runs SGLang's own scheduler;
`kv_events_config` names that publisher.

The frames are SGLang's, byte for byte: `[topic, seq (u64 big-endian), msgpack batch]`, the batch encoded by msgspec
as SGLang's thread encodes it, so `KvEventRelay` reads either. A PUB socket drops what its queue (the high-water mark)
cannot hold; the sequence number still advances, so the relay counts the gap as it does for SGLang's publisher.
SGLang's replay socket is not offered (the relay does not ask for replays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PUBLISHER_NAME = "conveyor-inline"


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Each data-parallel rank's own endpoint, as SGLang offsets it: a TCP port plus the rank."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        address, _, port = endpoint.rpartition(":")
        return f"{address}:{int(port) + data_parallel_rank}"
    raise ValueError(f"data-parallel rank {data_parallel_rank} needs a tcp:// KV-event endpoint, not {endpoint!r}")


def binds(endpoint: str) -> bool:
    """Whether a publisher binds `endpoint` or connects to it: SGLang's rule (a wildcard address or a local socket
    binds), so either publisher meets the relay the same way."""
    local = endpoint.startswith(("ipc://", "inproc://"))
    return local or any(wildcard in endpoint for wildcard in ("*", "::", "0.0.0.0"))


def _msgspec_encoder() -> Callable[[Any], bytes]:
    import msgspec  # SGLang's own dependency: present wherever a scheduler runs

    return msgspec.msgpack.Encoder().encode


class InlineKvEventPublisher:
    """SGLang's `EventPublisher` interface (`publish`, `shutdown`), sending on the caller's thread. SGLang's factory
    passes every `KVEventsConfig` field; those only its thread uses (`buffer_steps`, `max_queue_size`) are taken and
    left unused."""

    def __init__(self, attn_dp_rank: int = 0, endpoint: str = "tcp://*:5557", topic: str = "", hwm: int = 100_000,
                 replay_endpoint: str | None = None, buffer_steps: int = 0, max_queue_size: int = 0,
                 encode: Callable[[Any], bytes] | None = None) -> None:
        import zmq

        if replay_endpoint is not None:
            raise ValueError(f"the {PUBLISHER_NAME} KV-event publisher offers no replay socket; "
                             "leave replay_endpoint unset")
        self._zmq = zmq
        self._encode = encode or _msgspec_encoder()
        self._rank = attn_dp_rank
        self._topic = topic.encode()
        self.endpoint = offset_endpoint(endpoint, attn_dp_rank)
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        if binds(self.endpoint):
            self._socket.bind(self.endpoint)
        else:
            self._socket.connect(self.endpoint)
        self.next_seq = 0

    def publish(self, events: Any) -> None:
        if getattr(events, "attn_dp_rank", 0) is None:  # as SGLang's publisher marks a batch with its rank
            events.attn_dp_rank = self._rank
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        frames = (self._topic, seq.to_bytes(8, "big"), self._encode(events))
        # A PUB socket never blocks: at its high-water mark it drops the batch, and the relay counts the gap.
        self._socket.send_multipart(frames, flags=self._zmq.NOBLOCK)

    def shutdown(self) -> None:
        self._socket.close(linger=0)


def register_inline_publisher(factory: Any) -> None:
    """`InlineKvEventPublisher` in SGLang's `EventPublisherFactory` (once per process)."""
    try:
        factory.register_publisher(PUBLISHER_NAME, InlineKvEventPublisher)
    except KeyError:  # registered already in this process
        pass


def run_scheduler_with_inline_publisher(*args: Any, **kwargs: Any) -> None:
    """SGLang's scheduler process, with this module's publisher registered first (the target of each scheduler
    process the Engine below starts)."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory
    from sglang.srt.managers.scheduler import run_scheduler_process

    register_inline_publisher(EventPublisherFactory)
    run_scheduler_process(*args, **kwargs)


def inline_publisher_engine() -> type:
    """`sglang.Engine`, its schedulers started with the inline publisher registered."""
    # The class itself: `sglang.Engine` is a lazy-import proxy, which cannot be subclassed.
    from sglang.srt.entrypoints.engine import Engine

    if not hasattr(Engine, "run_scheduler_process_func"):  # the hook exists in the pinned SGLang, not in every one
        raise RuntimeError(f"this SGLang's Engine has no run_scheduler_process_func, so the {PUBLISHER_NAME} KV-event "
                           "publisher cannot be registered in its schedulers: set "
                           "CONVEYOR_SGLANG_KV_EVENTS_PUBLISHER=sglang for SGLang's own publisher")

    class InlinePublisherEngine(Engine):  # type: ignore[misc]
        run_scheduler_process_func = staticmethod(run_scheduler_with_inline_publisher)

    return InlinePublisherEngine
