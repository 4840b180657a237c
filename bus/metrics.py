"""Every Prometheus metric of a Conveyor process, declared once here.

Labels are bounded sets (stage, outcome, reason, frame kind), never request ids.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

MESSAGES_IN = Counter("conveyor_messages_in_total", "Tasks pulled from a work stream", ["stage"])
MESSAGES_OUT = Counter("conveyor_messages_out_total", "Tasks published to a work stream", ["stage"])
# outcome: acked | rejected (error frame sent, acked) | retried (nak) | terminated | cancelled | given_up
MESSAGES_HANDLED = Counter("conveyor_messages_handled_total", "Tasks by how their handling ended", ["stage", "outcome"])
HANDLER_SECONDS = Histogram(
    "conveyor_handler_seconds",
    "Time a handler spent on one task",
    ["stage"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
REDELIVERIES = Counter("conveyor_redeliveries_total", "Tasks pulled that had been delivered before", ["stage"])
# reason: undecodable | wire_version | max_deliver
TERMINATIONS = Counter("conveyor_terminations_total", "Tasks terminated without being handled", ["stage", "reason"])
IN_FLIGHT = Gauge("conveyor_in_flight", "Tasks being handled now", ["stage"])
REPLY_FRAMES = Counter("conveyor_reply_frames_total", "Frames published to reply inboxes", ["kind"])
# where: queued (dropped when pulled) | running (handler told) | received (seen on the control subject)
CANCELS = Counter("conveyor_cancels_total", "Cancels seen and acted on", ["where"])
CLIENTS_GONE = Counter("conveyor_clients_gone_total", "Streams stopped because the client stopped answering")
