"""JSON Schema for every wire message, for clients written in other languages."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter

from schemas.client import CLIENT_REQUEST, ChatRequest, CompletionRequest, EmbeddingRequest, ImageRequest
from schemas.control import Cancel, LoraAdapter
from schemas.kv_events import KvEventBatch
from schemas.registry import WorkerCard
from schemas.replies import (
    REPLY_FRAME,
    EmbeddingResult,
    ErrorFrame,
    FinalFrame,
    Heartbeat,
    ImageData,
    ImageProgress,
    ImageResult,
    TokenChunk,
)
from schemas.tasks import DecodeTask, EmbedTask, EncodeTask, ImageTask, PrefillTask

MESSAGES: tuple[type[BaseModel], ...] = (
    ChatRequest, CompletionRequest, EmbeddingRequest, ImageRequest,
    EncodeTask, PrefillTask, DecodeTask, EmbedTask, ImageTask,
    TokenChunk, Heartbeat, FinalFrame, ErrorFrame, EmbeddingResult, ImageProgress, ImageData, ImageResult,
    Cancel, LoraAdapter, KvEventBatch, WorkerCard,
)
UNIONS: dict[str, TypeAdapter[Any]] = {"ClientRequest": CLIENT_REQUEST, "ReplyFrame": REPLY_FRAME}


def all_schemas() -> dict[str, dict[str, Any]]:
    """Name -> JSON Schema, for each message and for the two unions a reader dispatches on."""
    schemas = {model.__name__: model.model_json_schema() for model in MESSAGES}
    for name, adapter in UNIONS.items():
        schemas[name] = adapter.json_schema()
    return schemas
