"""Reply streams: complete and ordered, never silent forever, and aware of a vanished client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg

from bus.connection import pub_prefix, publish_frames
from bus.errors import RemoteError, ReplyGap, ReplyStreamBroken
from bus.replies import ReplyInboxes, ReplySender, ReplyStream
from schemas.codec import decode, encode
from schemas.replies import ErrorCode, FinalFrame, FinishReason, TokenChunk, Usage
from tests.conftest import Bus
from tests.helpers import metric, open_stream, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]


async def test_ten_thousand_chunks_arrive_complete_and_in_order(bus: Bus) -> None:
    stream = await open_stream(bus, "bulk")
    sender = ReplySender(bus.nc, stream.inbox, "bulk")

    async def send_all() -> None:
        for token in range(10_000):
            await sender.send_tokens([token])
        await sender.finish(FinishReason.LENGTH, Usage.of(1, 10_000))

    producer = asyncio.create_task(send_all())
    chunks, final = await stream.collect()
    await producer
    assert [token for chunk in chunks for token in chunk.token_ids] == list(range(10_000))
    assert [chunk.seq for chunk in chunks] == list(range(10_000))
    assert isinstance(final, FinalFrame) and final.seq == 10_000 and final.usage.completion_tokens == 10_000


async def test_frames_written_as_one_command_arrive_in_order_and_an_oversized_one_is_refused(bus: Bus) -> None:
    received: list[tuple[str, bytes]] = []

    async def on_message(msg: Msg) -> None:
        received.append((msg.subject, msg.data))

    await bus.nc.subscribe("raw.>", cb=on_message)
    await publish_frames(bus.nc, (pub_prefix("raw.journal"), b"one"), (pub_prefix("raw.inbox"), b"one"))
    await publish_frames(bus.nc, (pub_prefix("raw.inbox"), b""))
    with pytest.raises(nats.errors.MaxPayloadError):
        await publish_frames(bus.nc, (pub_prefix("raw.inbox"), b"x" * (bus.nc.max_payload + 1)))
    await publish_frames(bus.nc, (pub_prefix("raw.inbox"), b"after"))
    await wait_until(lambda: len(received) >= 4)
    assert received == [("raw.journal", b"one"), ("raw.inbox", b"one"), ("raw.inbox", b""), ("raw.inbox", b"after")]
    assert bus.nc.is_connected
    with pytest.raises(nats.errors.BadSubjectError):
        pub_prefix("two words")


async def test_every_frame_sent_is_counted_once_the_stream_ends(bus: Bus) -> None:
    chunks_before, finals_before = metric("conveyor_reply_frames_total", kind="chunk"), metric(
        "conveyor_reply_frames_total", kind="final")
    stream = await open_stream(bus, "counted")
    async with ReplySender(bus.nc, stream.inbox, "counted") as sender:
        for token in range(45):  # more than one batch of the counter, and a remainder
            await sender.send_tokens([token])
        await sender.finish(FinishReason.LENGTH, Usage.of(1, 45))
    chunks, _ = await stream.collect()
    assert len(chunks) == 45
    assert metric("conveyor_reply_frames_total", kind="chunk") - chunks_before == 45
    assert metric("conveyor_reply_frames_total", kind="final") - finals_before == 1


async def test_coalescing_merges_tokens_into_fewer_frames_without_losing_any(bus: Bus) -> None:
    stream = await open_stream(bus, "coalesced")
    sender = ReplySender(bus.nc, stream.inbox, "coalesced", coalesce_window_s=0.05)
    for token in range(200):
        await sender.send_tokens([token], text=chr(ord("a") + token % 26))
    await sender.finish(FinishReason.STOP, Usage.of(1, 200))
    chunks, _ = await stream.collect()
    assert [token for chunk in chunks for token in chunk.token_ids] == list(range(200))
    assert "".join(chunk.text or "" for chunk in chunks) == "".join(chr(ord("a") + t % 26) for t in range(200))
    assert len(chunks) < 20


async def test_error_frame_raises_a_typed_remote_error(bus: Bus) -> None:
    stream = await open_stream(bus, "fails")
    sender = ReplySender(bus.nc, stream.inbox, "fails")
    await sender.send_tokens([1])
    await sender.fail(ErrorCode.OVERLOADED, "all decode workers busy", retryable=True)
    received: list[TokenChunk] = []
    with pytest.raises(RemoteError) as raised:
        async for chunk in stream:
            received.append(chunk)
    assert [c.token_ids for c in received] == [[1]]
    assert raised.value.code == ErrorCode.OVERLOADED and raised.value.frame.retryable


async def test_missing_frame_is_reported_as_a_gap_after_the_heartbeat_timeout(bus: Bus) -> None:
    stream = await open_stream(bus, "gappy")
    await bus.nc.publish(stream.inbox, encode(TokenChunk(request_id="gappy", seq=0, token_ids=[1])))
    await bus.nc.publish(stream.inbox, encode(TokenChunk(request_id="gappy", seq=2, token_ids=[3])))
    started = time.monotonic()
    with pytest.raises(ReplyGap, match="frame #1 missing, #2 arrived"):
        await stream.collect()
    assert 0.9 < time.monotonic() - started < 2.0  # heartbeat_timeout_s is 1.0 in the tests' settings


async def test_frames_out_of_order_within_the_window_are_read_in_order_and_duplicates_dropped(bus: Bus) -> None:
    stream = await open_stream(bus, "shuffled")
    for seq in (0, 2, 1, 1, 0):
        await bus.nc.publish(stream.inbox, encode(TokenChunk(request_id="shuffled", seq=seq, token_ids=[seq])))
    await bus.nc.publish(stream.inbox, encode(FinalFrame(request_id="shuffled", seq=3, finish_reason=FinishReason.STOP,
                                                         usage=Usage.of(1, 3))))
    chunks, _ = await stream.collect()
    assert [c.token_ids for c in chunks] == [[0], [1], [2]]


async def test_after_a_reconnect_the_sender_sends_again_what_the_client_lacks(bus: Bus) -> None:
    stream = await open_stream(bus, "outage")
    sender = ReplySender(bus.nc, stream.inbox, "outage")
    await sender.send_tokens([0])
    await sender.send_tokens([1])
    sender.reply_to = "_INBOX.nowhere"  # frames 2 and 3 are lost, as to a server that died holding them
    await sender.send_tokens([2])
    await sender.send_tokens([3])
    sender.reply_to = stream.inbox
    await sender.send_tokens([4])  # arrives ahead of the gap
    reading = asyncio.create_task(stream.collect())
    await asyncio.sleep(0.2)  # the reader has taken 0 and 1 and waits for 2
    await sender.resync(timeout_s=2.0)
    await sender.finish(FinishReason.STOP, Usage.of(1, 5))
    chunks, _ = await reading
    assert [c.token_ids for c in chunks] == [[0], [1], [2], [3], [4]]


async def test_heartbeats_keep_a_quiet_stream_open(bus: Bus) -> None:
    # heartbeat_interval_s=0.2 and heartbeat_timeout_s=1.0 (tests' settings): 2 s of silence survives.
    stream = await open_stream(bus, "slow")
    async with ReplySender(bus.nc, stream.inbox, "slow", heartbeat_interval_s=0.2) as sender:
        await sender.send_tokens([1])
        await asyncio.sleep(2.0)
        await sender.send_tokens([2])
        await sender.finish(FinishReason.STOP, Usage.of(1, 2))
    chunks, _ = await stream.collect()
    assert [c.token_ids for c in chunks] == [[1], [2]]


async def test_silent_stream_raises_within_its_window_instead_of_hanging(bus: Bus) -> None:
    stream = await open_stream(bus, "silent", first_frame_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ReplyStreamBroken, match="no frame yet"):
        await stream.collect()
    assert time.monotonic() - started < 1.5


SENDER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from bus.connection import connect
    from bus.replies import ReplyInboxes, ReplySender, ReplyStream
    from bus.settings import NatsSettings

    async def main() -> None:
        nc = await connect(NatsSettings(urls=[sys.argv[1]]), "dying-sender")
        async with ReplySender(nc, sys.argv[2], "dies", heartbeat_interval_s=0.2) as sender:
            await sender.send_tokens([1, 2, 3])
            print("sent", flush=True)
            await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


async def test_receiver_whose_sender_is_killed_raises_within_the_heartbeat_window(bus: Bus) -> None:
    stream = await open_stream(bus, "dies")
    sender = subprocess.Popen(
        [sys.executable, "-c", SENDER_SCRIPT, bus.nats_settings.urls[0], stream.inbox],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        chunks = stream.__aiter__()
        first = await asyncio.wait_for(chunks.__anext__(), timeout=20)
        assert first.token_ids == [1, 2, 3]
        await asyncio.sleep(0.5)  # heartbeats flow; the stream stays open
        killed_at = time.monotonic()
        sender.send_signal(signal.SIGKILL)
        with pytest.raises(ReplyStreamBroken, match="last frame"):
            await chunks.__anext__()
        # heartbeat_timeout_s is 1.0 in the tests' settings.
        assert time.monotonic() - killed_at < 1.5
    finally:
        sender.kill()
        sender.wait()


@pytest.mark.parametrize("shared", [False, True], ids=["own-subscription", "shared-subscription"])
async def test_sender_learns_that_its_client_went_away(bus: Bus, shared: bool) -> None:
    # Closing a stream read through a client's shared subscription leaves the subscription: the client answers the
    # probe `closed` instead of there being no responders.
    if shared:
        inboxes = ReplyInboxes(bus.nc)
        stream = ReplyStream(bus.nc, inboxes.new_inbox(), "gone", inboxes=inboxes)
        await stream.__aenter__()
    else:
        stream = await open_stream(bus, "gone")
    async with ReplySender(bus.nc, stream.inbox, "gone", heartbeat_interval_s=0.2) as sender:
        await sender.send_tokens([1])
        assert await sender.client_alive(timeout_s=1.0)
        await stream.close()
        await asyncio.wait_for(sender.client_gone.wait(), timeout=2.0)
        assert not await sender.client_alive(timeout_s=1.0)


async def test_a_client_reads_many_streams_through_one_subscription(bus: Bus) -> None:
    inboxes = ReplyInboxes(bus.nc)
    subscriptions_before = len(bus.nc._subs)  # nats-py's own count of this connection's subscriptions
    streams = [ReplyStream(bus.nc, inboxes.new_inbox(), f"shared-{index}", inboxes=inboxes) for index in range(3)]
    for stream in streams:
        await stream.__aenter__()
    assert len(bus.nc._subs) == subscriptions_before + 1
    senders = [ReplySender(bus.nc, stream.inbox, stream.request_id) for stream in streams]
    for token in range(5):  # interleaved: each frame must reach its own stream
        for index, sender in enumerate(senders):
            await sender.send_tokens([100 * index + token])
    for sender in senders:
        await sender.finish(FinishReason.LENGTH, Usage.of(1, 5))
    for index, stream in enumerate(streams):
        chunks, final = await stream.collect()
        assert [token for chunk in chunks for token in chunk.token_ids] == [100 * index + t for t in range(5)]
        assert isinstance(final, FinalFrame)
        await stream.close()
    assert len(bus.nc._subs) == subscriptions_before + 1


async def test_a_stream_whose_inbox_the_shared_subscription_does_not_cover_subscribes_itself(bus: Bus) -> None:
    inboxes = ReplyInboxes(bus.nc)
    stream = ReplyStream(bus.nc, bus.nc.new_inbox(), "own-inbox", inboxes=inboxes)
    async with stream:
        sender = ReplySender(bus.nc, stream.inbox, "own-inbox")
        await sender.send_tokens([7])
        await sender.finish(FinishReason.LENGTH, Usage.of(1, 1))
        chunks, _ = await stream.collect()
    assert [chunk.token_ids for chunk in chunks] == [[7]]


def test_fast_chunk_encoding_matches_the_schema_encoding() -> None:
    from bus.replies import _chunk_payload
    from schemas.replies import ChatChunkChoice, ChatChunkDelta, ChatCompletionChunk, ChatDelta, TokenLogprob, TopLogprob

    logprobs = [TokenLogprob(token_id=5, logprob=-0.5, top=[TopLogprob(token_id=6, logprob=-1.0)])]
    cases = [
        ({"token_ids": [1, 2]}, None),
        ({"token_ids": [3], "text": "é", "index": 2}, None),
        ({"token_ids": [5], "text": "x", "logprobs": logprobs},
         ChatChunkDelta(id="r", created=1, model="m", content="x", role="assistant")),
        ({"token_ids": [6], "text": "y", "index": 1}, ChatChunkDelta(id="r", created=1, model="m", index=1, content="y")),
        ({"token_ids": [], "text": ""}, ChatChunkDelta(id="r", created=1, model="m", finish_reason="stop",
                                                       usage=Usage.of(3, 4, cached_tokens=1))),
    ]
    for fields, delta in cases:
        # What the sender holds (a delta) encodes to what the schema's model would: receivers validate it as one.
        model = None if delta is None else ChatCompletionChunk(
            id=delta.id, created=delta.created, model=delta.model, usage=delta.usage,
            choices=[ChatChunkChoice(index=delta.index, finish_reason=delta.finish_reason,
                                     delta=ChatDelta(role=delta.role, content=delta.content))])
        expected = encode(TokenChunk(request_id="r", seq=7, openai=model, **fields))
        assert _chunk_payload("r", 7, fields | ({"openai": delta} if delta else {})) == expected
        if delta is not None:
            assert decode(expected, TokenChunk).openai == model
