"""Embed stage: token-id inputs → one vector each, as OpenAI's /v1/embeddings returns them.

Consumes `EmbedTask` from `{ns}.work.embed.{model}`: the processor has tokenized OpenAI's four input
shapes (a text, texts, token ids, lists of token ids) into token-id lists. The worker encodes them in
length-sorted batches (`SentenceEmbedder` on torch; SGLang with `is_embedding` on a GPU), truncates to `dimensions` when asked (Matryoshka: cut, then
normalized again), and answers with one `EmbeddingResult` frame: vectors in input order as float lists,
or — `encoding_format: base64` — as the little-endian float32 bytes OpenAI base64-encodes; usage counts
prompt tokens (completion tokens are 0).

Fails how (error frame, ack; the worker keeps serving): an input longer than the model's positions →
`context_length_exceeded`; more than `MAX_INPUTS` inputs, or `dimensions` above the model's size →
`invalid_request`. A cancel that lands before the batch is encoded answers `cancelled`.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Protocol

import structlog
import torch

from bus.consumer import Delivery
from bus.errors import RejectRequest
from bus.metrics import QUEUE_SECONDS, REQUESTS
from schemas.registry import Stage
from schemas.replies import Embedding, ErrorCode, FinishReason, Usage
from schemas.tasks import EmbedTask
from workers.engines.torch_engine.embedding import SentenceEmbedder
from workers.runtime import StageContext

log = structlog.get_logger(__name__)

# OpenAI's limit on inputs per request (the processor refuses more before tokenizing; a raw task is checked here).
MAX_INPUTS = 2048


class Embedder(Protocol):
    """What the stage needs of a model: vectors for token-id lists, its size and its longest input."""

    dimensions: int
    max_tokens: int

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """[len(inputs), dimensions] float32, in input order."""


class TorchEmbedder:
    """A sentence-transformers model on torch, in a thread (a forward uses every core)."""

    def __init__(self, model: SentenceEmbedder) -> None:
        self._model = model
        self.dimensions, self.max_tokens = model.dimensions, model.max_tokens

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        return await asyncio.to_thread(self._model.embed, inputs)


class EmbedStage:
    task_type = EmbedTask
    accepts_media = False
    journals_replies = False
    # No generation engine: no KV events, load gauges or engine-control routes.
    engine = None

    def __init__(self, embedder: Embedder, model: str) -> None:
        self._embedder = embedder
        self.model = self.consumes_model = model

    async def start(self, context: StageContext) -> None:
        await self._embedder.start()

    async def stop(self) -> None:
        await self._embedder.stop()

    async def canary(self) -> None:
        vectors = await self._embedder.embed([[101, 102]])
        if vectors.shape != (1, self._embedder.dimensions) or not torch.isfinite(vectors).all():
            raise RuntimeError(f"embedding canary gave {tuple(vectors.shape)}")

    async def handle(self, task: EmbedTask, delivery: Delivery) -> None:
        QUEUE_SECONDS.labels(stage=Stage.EMBED.value).observe(delivery.queued_s)
        self._validate(task)
        vectors = await self._embedder.embed(task.inputs)
        num_tokens = sum(len(ids) for ids in task.inputs)
        if delivery.cancelled.is_set():
            await delivery.reply.finish(FinishReason.CANCELLED, Usage.of(num_tokens, 0))
            return
        if task.dimensions is not None and task.dimensions < vectors.shape[1]:
            vectors = torch.nn.functional.normalize(vectors[:, : task.dimensions], p=2, dim=1)
        data = [Embedding(index=index, vector=_encode_vector(row, task.encoding_format))
                for index, row in enumerate(vectors)]
        await delivery.reply.send_embeddings(self.model, data, Usage.of(num_tokens, 0))
        REQUESTS.labels(stage=Stage.EMBED.value, model=self.model, outcome="embedded").inc()

    def _validate(self, task: EmbedTask) -> None:
        if len(task.inputs) > MAX_INPUTS:
            raise RejectRequest(ErrorCode.INVALID_REQUEST, f"{len(task.inputs)} inputs; at most {MAX_INPUTS} per request")
        if any(not ids for ids in task.inputs):
            raise RejectRequest(ErrorCode.INVALID_REQUEST, "an input is empty")
        longest = max(len(ids) for ids in task.inputs)
        if longest > self._embedder.max_tokens:
            raise RejectRequest(ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                                f"an input of {longest} tokens exceeds the model's {self._embedder.max_tokens}")
        if task.dimensions is not None and task.dimensions > self._embedder.dimensions:
            raise RejectRequest(ErrorCode.INVALID_REQUEST, f"dimensions {task.dimensions} exceeds the model's "
                                f"{self._embedder.dimensions}")


def _encode_vector(row: torch.Tensor, encoding_format: str) -> list[float] | bytes:
    values = row.tolist()
    if encoding_format == "base64":
        return struct.pack(f"<{len(values)}f", *values)  # OpenAI's bytes: little-endian float32
    return values
