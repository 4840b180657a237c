"""Connect to NATS from `NatsSettings`, with reconnects and logged connection events."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

import nats
import structlog
from nats.aio.client import Client

from bus.settings import NatsSettings

log = structlog.get_logger(__name__)

Callback = Callable[[], Awaitable[None]]
ErrorCallback = Callable[[Exception], Awaitable[None]]


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    if not settings.uses_tls:
        return None
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None
    )
    if settings.tls_cert_file and settings.tls_key_file:
        context.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return context


async def connect(settings: NatsSettings, name: str, on_reconnected: Callback | None = None) -> Client:
    """Open a connection; raises `ConnectionError` with the URLs tried when none answers.

    nats-py re-subscribes by itself after a reconnect, but what the server kept in memory (or all of
    it, when the server came back with an empty store) is gone: `on_reconnected` is where the
    caller declares it again. It runs inside the client's reconnect path, so it must return quickly.
    """

    errors = _ErrorLog(name)

    async def on_disconnect() -> None:
        log.info("nats.disconnected", name=name)

    async def on_reconnect() -> None:
        errors.reset()
        log.info("nats.reconnected", name=name)
        if on_reconnected is not None:
            await on_reconnected()

    try:
        async with asyncio.timeout(settings.initial_connect_timeout_s):  # not wait_for: see bus/lifecycle.py
            client = await _connect(settings, name, on_disconnect, on_reconnect, errors.on_error)
    except Exception as error:
        # nats-py retries unreachable servers, or raises a bare NoServersError: one sentence with the fix instead.
        cause = errors.last or repr(error)
        raise ConnectionError(
            f"cannot reach NATS at {', '.join(settings.urls)} ({cause}): start one with `conveyor server` or "
            "`conveyor up`, or point --nats / CONVEYOR_NATS_URLS at yours") from error
    errors.connected = True
    return client


async def close_connection(nc: Client, drain_timeout_s: float = 0.0) -> None:
    """Close `nc`, first draining it for up to `drain_timeout_s` (delivering what it buffered) when the server is there.

    With the server away, nats-py's `close` writes what it buffered while reconnecting to the transport that died with
    the server, which uvloop refuses with a RuntimeError: the close stops half way and the process exits with a
    traceback (seen when a NATS server stopped before its workers). That buffer can reach no one, so it is dropped
    first and the close runs to its end; a close that fails all the same is logged, not raised: the process is ending.
    """
    if nc.is_closed:
        return
    if drain_timeout_s > 0 and nc.is_connected:
        try:
            async with asyncio.timeout(drain_timeout_s):
                await nc.drain()
        except Exception as error:
            log.warning("nats.drain_skipped", error=repr(error))
    if nc.is_closed:  # a drain ends in a close
        return
    if not nc.is_connected:
        nc._pending, nc._pending_data_size = [], 0
    try:
        await nc.close()
    except Exception as error:
        log.warning("nats.close_incomplete", error=repr(error))


class _ErrorLog:
    """Connection errors as a person wants them: none while the first connect is still trying (its
    failure is one `ConnectionError`), then one line per distinct error until the next reconnect,
    not one per retry."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.connected = False
        self.last: str | None = None

    async def on_error(self, error: Exception) -> None:
        text = str(error) or type(error).__name__
        if text == self.last:
            return
        self.last = text
        if self.connected:
            log.warning("nats.error", name=self._name, error=text)

    def reset(self) -> None:
        self.last = None


async def _connect(settings: NatsSettings, name: str, on_disconnect: Callback, on_reconnect: Callback,
                   on_error: ErrorCallback) -> Client:
    return await nats.connect(
        servers=settings.urls,
        name=name,
        user=settings.user,
        password=settings.password,
        token=settings.token,
        user_credentials=str(settings.creds_file) if settings.creds_file else None,
        nkeys_seed=str(settings.nkey_seed_file) if settings.nkey_seed_file else None,
        tls=tls_context(settings),
        inbox_prefix=settings.inbox_prefix,
        ping_interval=settings.ping_interval_s,
        max_outstanding_pings=settings.max_outstanding_pings,
        connect_timeout=settings.connect_timeout_s,
        reconnect_time_wait=settings.reconnect_wait_s,
        max_reconnect_attempts=settings.max_reconnect_attempts,
        pending_size=settings.reconnect_buffer_bytes,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )


def pub_prefix(subject: str) -> bytes:
    """The start of a core NATS PUB command to `subject`, built once per subject for `publish_frames`."""
    if not subject or " " in subject:
        raise nats.errors.BadSubjectError
    return b"PUB " + subject.encode() + b" "


async def publish_frames(nc: Client, *frames: tuple[bytes, bytes]) -> None:
    """Publish header-less messages in order, as one protocol command: each frame is (`pub_prefix(subject)`, payload).

    What nats-py's `publish` does per message (its checks, a PUB line formatted from the subject, stats) cost a
    streaming worker ~5 µs per message, and it sends a frame and its journal record per token. This writes the same
    bytes into the same pending buffer, and kicks the same flusher. While the connection is not up, nats-py's own
    `publish` takes them, to buffer or refuse them by its rules. nats-py's internals used here are pinned by the
    tests of every reply stream.
    """
    if not nc.is_connected or nc.is_draining_pubs:
        for prefix, payload in frames:
            await nc.publish(prefix[4:-1].decode(), payload)
        return
    commands, num_bytes = [], 0
    for prefix, payload in frames:
        size = len(payload)
        if size > nc.max_payload:
            raise nats.errors.MaxPayloadError
        commands.append(b"%b%d\r\n%b\r\n" % (prefix, size, payload))
        num_bytes += size
    nc.stats["out_msgs"] += len(frames)
    nc.stats["out_bytes"] += num_bytes
    await nc._send_command(commands[0] if len(commands) == 1 else b"".join(commands))
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
