"""W3C trace context (`traceparent`) carried from hop to hop in message headers.

Each hop keeps the trace id and mints its own span id, so a trace collector can stitch one
request's path through processor, prefill and decode back together.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

TRACEPARENT_HEADER = "traceparent"
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


@dataclass(frozen=True, slots=True)
class TraceContext:
    trace_id: str
    span_id: str
    sampled: bool = True

    @classmethod
    def new(cls) -> TraceContext:
        return cls(trace_id=secrets.token_hex(16), span_id=secrets.token_hex(8))

    @classmethod
    def from_headers(cls, headers: dict[str, str] | None) -> TraceContext:
        """The incoming context, or a fresh trace when the header is missing or malformed."""
        match = _TRACEPARENT.match((headers or {}).get(TRACEPARENT_HEADER, ""))
        if match is None:
            return cls.new()
        trace_id, span_id, flags = match.groups()
        return cls(trace_id=trace_id, span_id=span_id, sampled=bool(int(flags, 16) & 1))

    def child(self) -> TraceContext:
        return TraceContext(trace_id=self.trace_id, span_id=secrets.token_hex(8), sampled=self.sampled)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"
