"""Settings for reaching NATS and for the bus's own tunables, read from `CONVEYOR_*` variables.

Each setting is documented where it is declared; `conveyor --help` and the README's table list the
variables. Values are read once at start and passed down; nothing changes them at run time.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated


def _split_urls(value: object) -> object:
    if isinstance(value, str):
        return [url.strip() for url in value.replace(" ", ",").split(",") if url.strip()]
    return value


class NatsSettings(BaseSettings):
    """How to connect: servers, credentials, TLS, and how fast to notice a dead peer."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_NATS_", frozen=True)

    # Comma-separated in the environment: CONVEYOR_NATS_URLS=nats://a:4222,nats://b:4222
    urls: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    creds_file: Path | None = None
    nkey_seed_file: Path | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Reply inboxes live under this prefix; secured deployments give each client its own.
    inbox_prefix: str = "_INBOX"
    # A peer that misses `max_outstanding_pings` pings `ping_interval_s` apart is declared dead. nats-py counts a
    # PONG only when its read loop gets to it, behind every frame received before it: a client reading a burst
    # of streams (a gateway) that fell more than this far behind dropped its own connection and lost every frame
    # in flight (at 2 s × 2, 2 of 5 runs of scripts/bench_fanin.py at 90k frames/s; none at 10 s × 3). A server
    # that dies closes its sockets and is noticed at once; this bounds only a silent one.
    ping_interval_s: float = Field(default=10.0, gt=0)
    max_outstanding_pings: int = Field(default=3, ge=1)
    connect_timeout_s: float = Field(default=5.0, gt=0)
    # Give up the first connection after this long (later disconnects reconnect forever).
    initial_connect_timeout_s: float = Field(default=10.0, gt=0)
    reconnect_wait_s: float = Field(default=0.5, gt=0)
    # -1 reconnects forever: a worker rides out a NATS restart.
    max_reconnect_attempts: int = -1
    # What a connection buffers while reconnecting (a decode worker's frames during a server restart).
    reconnect_buffer_bytes: int = Field(default=32 << 20, ge=1 << 20)

    @model_validator(mode="before")
    @classmethod
    def _urls_from_string(cls, data: object) -> object:
        if isinstance(data, dict) and "urls" in data:
            data = {**data, "urls": _split_urls(data["urls"])}
        return data

    @model_validator(mode="after")
    def _tls_pair(self) -> NatsSettings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS client auth needs both CONVEYOR_NATS_TLS_CERT_FILE and CONVEYOR_NATS_TLS_KEY_FILE")
        if self.user is not None and self.password is None:
            raise ValueError("CONVEYOR_NATS_USER is set but CONVEYOR_NATS_PASSWORD is not")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca_file is not None or self.tls_cert_file is not None or any(
            url.startswith("tls://") for url in self.urls
        )


class BusSettings(BaseSettings):
    """Limits and timings of streams, consumers and reply streams."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", frozen=True)

    # Subjects, streams and buckets are named from this, so tenants can share one server.
    namespace: str = Field(default="conveyor", pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=32)
    # Copies JetStream keeps of every stream and the registry bucket: 1 on a single server, 3 on a cluster
    # of 3 or more (any one node may then die without losing work, journals or cards).
    stream_replicas: int = Field(default=1, ge=1, le=5)
    # Work older than this is dropped by the stream (a client waits far less than an hour).
    work_max_age_s: float = Field(default=3600.0, gt=0)
    work_max_msgs: int = Field(default=1_000_000, ge=1)
    # Reserved in JetStream's storage per stage stream, so kept modest; raise it for deep queues.
    work_max_bytes: int = Field(default=256 << 20, ge=1)
    # A re-published task with the same Nats-Msg-Id inside this window is dropped as a duplicate.
    dedupe_window_s: float = Field(default=120.0, gt=0)
    # Largest task we publish; checked before sending, and never above the server's max_payload.
    max_message_bytes: int = Field(default=8 << 20, ge=1024)
    kv_events_max_age_s: float = Field(default=3600.0, gt=0)
    # Dead letters (tasks a stage gave up on) are kept this long for `conveyor dlq`.
    dead_letter_max_age_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    # Reply journals (for migration) are kept this long after their last record, within this many bytes.
    journal_max_age_s: float = Field(default=900.0, gt=0)
    journal_max_bytes: int = Field(default=256 << 20, ge=1 << 20)
    # Cancels are remembered this long, so a request pulled later is still dropped.
    cancel_ttl_s: float = Field(default=600.0, gt=0)
    # A worker whose card is not refreshed within this is gone from the registry.
    registry_ttl_s: float = Field(default=10.0, ge=1.0)
    # A session no request used for this long is closed (its worker forgets it, the processors forget where it was).
    session_idle_s: float = Field(default=600.0, ge=1.0)
    # A dead worker's pinned consumer is deleted by the server after this long unused (its tasks are moved
    # back to the shared queue long before, once its registry card expires).
    pinned_consumer_idle_s: float = Field(default=3600.0, gt=0)
    # JetStream redelivers a task whose handler neither acked nor sent in_progress in this time, so it
    # is how long a dead worker's request waits before another replica takes it over (in_progress goes
    # out every third of it). Keep it below `heartbeat_timeout_s`, or clients give up first.
    ack_wait_s: float = Field(default=4.0, gt=0)
    # Deliveries of one task before it is given up (terminated, and the client told).
    max_deliver: int = Field(default=5, ge=1)
    # Delay before a nak'ed task is redelivered: base * 2**(delivery-1), capped.
    retry_base_s: float = Field(default=0.5, gt=0)
    retry_max_s: float = Field(default=10.0, gt=0)
    # Replies: a quiet sender heartbeats at this interval; a receiver gives up after the timeout.
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    # The timeout covers a takeover: a dead worker's request resumes within `ack_wait_s` and a fetch.
    heartbeat_timeout_s: float = Field(default=10.0, gt=0)
