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
# A garbage collection stops the whole process, its event loop (and every stream's next token) included.
GC_PAUSE = Histogram("conveyor_gc_pause_seconds", "Time one garbage collection stopped the process", ["generation"],
                     buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
# How late a timer fires on the process's event loop: what any ready callback (a token's next hop, a task's ack)
# waits behind the others. Near the timer interval or more, the loop is saturated (docs/performance.md).
EVENT_LOOP_LAG = Histogram("conveyor_event_loop_lag_seconds", "How late a timer fired on the process's event loop",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
CLIENTS_GONE = Counter("conveyor_clients_gone_total", "Streams stopped because the client stopped answering")

# Per-request serving metrics, observed by the stage that streams to the client.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# outcome: stop | length | cancelled | error | rejected
REQUESTS = Counter("conveyor_requests_total", "Requests finished, by outcome", ["stage", "model", "outcome"])
TIME_TO_FIRST_TOKEN = Histogram("conveyor_time_to_first_token_seconds", "Request entering the pipeline to first token",
                                ["model"], buckets=_LATENCY_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("conveyor_inter_token_latency_seconds",
                                "Time between streamed tokens (a frame of n tokens: its gap over n)", ["model"],
                                buckets=(0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                                         0.25, 0.5, 1))
END_TO_END = Histogram("conveyor_request_seconds", "Request entering the pipeline to its final frame", ["model"],
                       buckets=_LATENCY_BUCKETS)
QUEUE_SECONDS = Histogram("conveyor_queue_seconds", "Time a task waited in its work stream", ["stage"],
                          buckets=_LATENCY_BUCKETS)
ENGINE_RUNNING = Gauge("conveyor_engine_running_requests", "Requests the engine is generating", ["stage", "model"])
ENGINE_WAITING = Gauge("conveyor_engine_waiting_requests", "Requests queued inside the engine", ["stage", "model"])
KV_USAGE = Gauge("conveyor_kv_cache_usage_ratio", "Used fraction of the engine's KV blocks", ["stage", "model"])
CACHE_HIT_RATE = Gauge("conveyor_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache", ["stage", "model"])
KV_EVENT_BATCHES = Counter("conveyor_kv_event_batches_total", "KV-event batches relayed to the stream", ["stage"])
WORKER_READY = Gauge("conveyor_worker_ready", "1 when the worker takes work", ["stage"])
# The canary's checks of a worker's engine (outcome: passed | failed | deferred: requests ending well were the check).
CANARIES = Counter("conveyor_canaries_total", "Canary checks of the worker's engine", ["stage", "outcome"])

# Multimodal: the encode stage's embedding cache (result: hit | miss) and its NIXL handoffs
# (outcome: read | cancelled | expired).
MEDIA_CACHE = Counter("conveyor_media_cache_total", "Image embedding cache lookups", ["result"])
EMBEDDING_HANDOFFS = Counter("conveyor_embedding_handoffs_total", "Embedding buffers offered over NIXL, by how they ended",
                             ["outcome"])
# reason: undecodable | wire_version | max_deliver | failed_mid_stream
DEAD_LETTERS = Counter("conveyor_dead_letters_total", "Tasks kept in the dead-letter stream", ["stage", "reason"])

# Migration: a request taken over mid-stream by another replica. outcome: migrated | ended_already (only the
# ack was lost) | holder_alive (the journal is fresh: handed back for later) | over_limit | over_max_seq_len |
# not_migratable (guided decoding, n > 1)
MIGRATIONS = Counter("conveyor_migrations_total", "Redelivered streaming requests, by what became of them", ["stage", "outcome"])

# KV-aware routing (bus/router.py). outcome: hit (a replica held part of the prompt) | miss | shared (queue mode,
# or no replica to choose)
ROUTER_DECISIONS = Counter("conveyor_router_decisions_total", "Routing decisions of the processor", ["mode", "outcome"])
ROUTER_PREDICTED_TOKENS = Counter("conveyor_router_predicted_cached_tokens_total",
                                  "Prompt tokens the router expected the chosen replica to have cached")
ROUTER_ACTUAL_TOKENS = Counter("conveyor_router_actual_cached_tokens_total",
                               "Prompt tokens routed replicas found cached (compare with the predicted total)")
KV_INDEX_BLOCKS = Gauge("conveyor_router_index_blocks", "Distinct KV blocks in the router's index")
UNPINNED_TASKS = Counter("conveyor_unpinned_tasks_total", "Pinned tasks moved back to the shared queue (worker gone)",
                         ["stage"])
# Conditional disaggregation: where a disaggregated model's prompt ran. where: remote (a prefill worker) | local
DISAGGREGATION_DECISIONS = Counter("conveyor_disaggregation_decisions_total",
                                   "Prompts of disaggregated models, by where the router sent them and why",
                                   ["where", "why"])
POOL_CHOICES = Counter("conveyor_pool_choices_total", "Tasks sent to each pool (bus/pools.py)",
                       ["stage", "pool", "why"])
POOL_HANDOVERS = Counter("conveyor_pool_handovers_total",
                         "Tasks that failed before any output and were handed to a faster pool", ["stage", "pool"])

QUEUE_TASKS = Gauge(
    "conveyor_queue_tasks",
    "A stage's shared queue as JetStream counts it (every replica reports it: take max by stage, model): "
    "state=waiting not yet delivered, state=delivered being worked on (not yet acked)",
    ["stage", "model", "state"],
)
ERRORS = Counter("conveyor_errors_total", "Error frames sent to clients, by error code", ["code"])
