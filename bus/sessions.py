"""The `{ns}_sessions` bucket: which worker holds each open session, so every processor pins a session's requests
to it. The processor that routes a session's first request chooses the worker and creates the entry (atomically:
two processors racing on one new id agree on the first entry); each later request rewrites it, and the bucket's
TTL — the session idle time — forgets sessions nobody used, as their worker does.
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from bus.settings import BusSettings
from bus.subjects import Names


async def ensure_session_bucket(js: JetStreamContext, names: Names, settings: BusSettings) -> KeyValue:
    try:
        return await js.key_value(names.session_bucket)
    except (NotFoundError, BadRequestError):
        config = KeyValueConfig(bucket=names.session_bucket, description="Conveyor sessions: the worker holding each",
                                ttl=settings.session_idle_s, history=1, replicas=settings.stream_replicas,
                                storage=StorageType.FILE)
        return await js.create_key_value(config)


class SessionPlaces:
    def __init__(self, bucket: KeyValue) -> None:
        self._bucket = bucket

    async def worker_of(self, session_id: str) -> str | None:
        try:
            entry = await self._bucket.get(session_id)
        except KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None

    async def place(self, session_id: str, worker_id: str) -> str:
        """Put a new session on `worker_id`, unless another processor placed it first: the worker it is on."""
        try:
            await self._bucket.create(session_id, worker_id.encode())
        except KeyWrongLastSequenceError:
            return await self.worker_of(session_id) or worker_id
        return worker_id

    async def touch(self, session_id: str, worker_id: str) -> None:
        """A request used the session: it stays remembered for another idle period."""
        await self._bucket.put(session_id, worker_id.encode())

    async def forget(self, session_id: str) -> None:
        await self._bucket.delete(session_id)
