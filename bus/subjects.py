"""Every subject, stream, consumer and bucket name, computed from a namespace (and a model).

Work for a stage goes to `{ns}.work.{stage}`; stages that need a model's weights (encode, prefill,
decode, embed) take work per model, on `{ns}.work.{stage}.{model_token}`, so a decode worker for one
model never pulls another model's tasks. A model served by several pools (bus/pools.py) has one queue per
pool besides, `{ns}.work.{stage}.{model_token}.pool.{pool}`, pulled by that pool's replicas only. One work-queue
stream per stage holds every form.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from schemas.registry import Stage

_UNSAFE_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


def model_token(model: str) -> str:
    """A model name as one subject token and a legal consumer name (no dots, slashes, spaces).

    Names that had to be changed get a short hash so `org/m.1` and `org_m_1` stay distinct.
    """
    safe = _UNSAFE_TOKEN.sub("_", model)
    if safe == model:
        return model
    digest = hashlib.blake2s(model.encode(), digest_size=4).hexdigest()
    return f"{safe[:48]}_{digest}"


@dataclass(frozen=True, slots=True)
class Names:
    namespace: str

    @property
    def _prefix(self) -> str:
        # Stream and bucket names may not contain dots; upper case marks them apart from subjects.
        return self.namespace.upper().replace("-", "_")

    def work_subject(self, stage: Stage, model: str | None = None, pool: str | None = None) -> str:
        base = f"{self.namespace}.work.{stage.value}"
        if model is None:
            return base
        return f"{base}.{model_token(model)}" + (f".pool.{pool}" if pool is not None else "")

    def pinned_subject(self, stage: Stage, model: str | None, worker_id: str) -> str:
        """Work for one replica only: a router pinned it there (its prefix is cached there)."""
        return f"{self.work_subject(stage, model)}.pinned.{worker_id}"

    def pinned_consumer(self, stage: Stage, model: str | None, worker_id: str) -> str:
        return f"{self.work_consumer(stage, model)}_pinned_{worker_id}"

    def work_stream(self, stage: Stage) -> str:
        return f"{self._prefix}_WORK_{stage.value.upper()}"

    def work_stream_subjects(self, stage: Stage) -> list[str]:
        base = f"{self.namespace}.work.{stage.value}"
        return [base, f"{base}.>"]

    def work_consumer(self, stage: Stage, model: str | None = None, pool: str | None = None) -> str:
        """The durable consumer every replica of a stage (for a model, in a pool) shares."""
        if model is None:
            return stage.value
        return f"{stage.value}_{model_token(model)}" + (f"_pool_{pool}" if pool is not None else "")

    @property
    def cancel_subject(self) -> str:
        """Cancels of any request (trusted publishers); `cancel_subject_for(scope)` for one client's own."""
        return f"{self.namespace}.control.cancel"

    def cancel_subject_for(self, scope: str | None) -> str:
        return self.cancel_subject if scope is None else f"{self.cancel_subject}.{scope}"

    @property
    def cancel_subjects(self) -> list[str]:
        return [self.cancel_subject, f"{self.cancel_subject}.*"]

    def cancel_scope(self, subject: str) -> str | None:
        """The scope a cancel was published in (None: the bare subject, any request)."""
        return subject[len(self.cancel_subject) + 1 :] if subject != self.cancel_subject else None

    @property
    def control_stream(self) -> str:
        return f"{self._prefix}_CONTROL"

    def load_subject(self, worker_id: str) -> str:
        return f"{self.namespace}.load.{worker_id}"

    @property
    def load_subjects(self) -> str:
        return f"{self.namespace}.load.*"

    def kv_events_subject(self, worker_id: str) -> str:
        return f"{self.namespace}.kv.{worker_id}"

    @property
    def kv_events_subjects(self) -> str:
        return f"{self.namespace}.kv.>"

    @property
    def kv_events_stream(self) -> str:
        return f"{self._prefix}_KV_EVENTS"

    def dead_letter_subject(self, stage: str) -> str:
        return f"{self.namespace}.dead.{stage}"

    @property
    def dead_letter_stream(self) -> str:
        return f"{self._prefix}_DEAD_LETTERS"

    def progress_subject(self, request_id: str) -> str:
        return f"{self.namespace}.progress.{request_id}"

    @property
    def progress_stream(self) -> str:
        return f"{self._prefix}_PROGRESS"

    @property
    def router_snapshot_bucket(self) -> str:
        """Object store of the KV router's index snapshots."""
        return f"{self.namespace}_router"

    @property
    def router_snapshot_stream(self) -> str:
        # JetStream keeps an object store in a stream of this name; made by the first router that saves.
        return f"OBJ_{self.router_snapshot_bucket}"

    @property
    def registry_bucket(self) -> str:
        return f"{self.namespace}_workers"

    @property
    def registry_stream(self) -> str:
        # JetStream keeps a KV bucket in a stream of this name.
        return f"KV_{self.registry_bucket}"

    @property
    def lora_bucket(self) -> str:
        """The LoRA adapters the deployment serves, by name (made by the first worker or client that needs it)."""
        return f"{self.namespace}_loras"

    @property
    def lora_stream(self) -> str:
        return f"KV_{self.lora_bucket}"

    @property
    def session_bucket(self) -> str:
        """Which worker holds each open session (written by the processor that opened it)."""
        return f"{self.namespace}_sessions"

    @property
    def session_stream(self) -> str:
        return f"KV_{self.session_bucket}"

    @property
    def all_streams(self) -> list[str]:
        """Every stream this namespace declares."""
        work = [self.work_stream(stage) for stage in Stage]
        return [*work, self.control_stream, self.kv_events_stream, self.dead_letter_stream, self.progress_stream,
                self.registry_stream, self.lora_stream, self.session_stream]
