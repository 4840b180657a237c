"""The embedded engine: a compact paged-KV, continuous-batching LLM engine in PyTorch.

One concept per file, in the order a request meets them:
`loader` (model files, GGUF import) → `model` (Llama/Qwen2 forward over a paged cache) →
`sequence` (a request's state) → `block_manager` (KV blocks, prefix cache, KV events) →
`scheduler` (who runs this step, chunked prefill) → `sampler` → `runner` (one step) →
`engine` (thread + asyncio facade implementing `workers.engines.protocol.Engine`).
"""
