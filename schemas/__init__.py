"""The wire contract of Conveyor: every message that crosses NATS, as pydantic v2 models.

This package imports nothing else of ours, so a client in any language can be written from it
(`conveyor schema` exports JSON Schema for every message). One module per hop:

- `client`     what users publish to `{ns}.work.processor` (chat, completion, embedding requests)
- `sampling`   sampling options and stop conditions, shared by every generation hop
- `tasks`      processor → encode / prefill / decode / embed (preprocessed requests, bootstrap handoff)
- `replies`    frames a worker streams to a reply inbox (chunk, heartbeat, final, error)
- `control`    `Cancel` on the control subject
- `kv_events`  KV-cache events in SGLang's shapes, batched per worker with a sequence number
- `registry`   worker cards in the registry bucket
- `codec`      msgpack encoding and the wire-version header
"""
