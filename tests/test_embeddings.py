"""Embeddings through processor → embed worker on the real all-MiniLM-L6-v2: parity with
sentence-transformers, OpenAI's input shapes and encodings, the gateway with the openai SDK, and bad
inputs answered by typed errors from a worker that keeps serving."""

from __future__ import annotations

import base64
import json
import struct
import uuid

import openai
import pytest
import torch

from bus.errors import RemoteError
from schemas.client import EmbeddingRequest
from schemas.registry import ServingMode, Stage
from schemas.replies import EmbeddingResult, ErrorCode
from tests.conftest import Bus
from tests.pipeline_helpers import client_of, run_cli_when_served, running_workers, worker_processes
from workers.engines.factory import EngineKind
from workers.engines.torch_engine.embedding import EMBEDDING_MODEL, SentenceEmbedder, bundled_minilm
from workers.gateway import GatewayOptions, serving
from workers.processor import ProcessorStage
from workers.stages import _embed_stage, served_model

SENTENCES = [
    "The cat sits on the mat.",
    "A feline rests on a rug.",
    "Stock markets fell sharply on Monday.",
    "NATS JetStream carries every task between the stages.",
    "",  # replaced below: empty inputs are refused, tested on their own
]
SENTENCES = [s for s in SENTENCES if s]


def specs() -> list:  # type: ignore[type-arg]
    return [(Stage.PROCESSOR, ProcessorStage({EMBEDDING_MODEL: served_model(EngineKind.TORCH, EMBEDDING_MODEL)})),
            (Stage.EMBED, _embed_stage(EngineKind.TORCH, EMBEDDING_MODEL))]


async def embed(bus: Bus, inputs: object, **fields: object) -> EmbeddingResult:
    client = client_of(bus)
    request = EmbeddingRequest(request_id=f"e-{uuid.uuid4().hex[:12]}", reply_to=client.new_inbox(),
                               model=EMBEDDING_MODEL, input=inputs, **fields)  # type: ignore[arg-type]
    async with await client.submit(request, first_frame_timeout_s=60) as stream:
        _, result = await stream.collect()
    assert isinstance(result, EmbeddingResult)
    return result


def test_embeddings_match_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(bundled_minilm()), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    embedder = SentenceEmbedder(bundled_minilm())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(bundled_minilm()))
    ours = embedder.embed([tokenizer.encode(s) for s in SENTENCES])
    cosines = torch.nn.functional.cosine_similarity(ours, reference.cpu().float(), dim=1)
    assert cosines.min().item() >= 0.9999, cosines


async def test_every_input_shape_and_encoding_through_the_bus(bus: Bus) -> None:
    async with running_workers(bus, specs(), model=EMBEDDING_MODEL, mode=ServingMode.EMBEDDING):
        one = await embed(bus, SENTENCES[0])
        many = await embed(bus, SENTENCES)
        as_tokens = await embed(bus, [101, 1037, 4937, 102])
        as_token_lists = await embed(bus, [[101, 1037, 4937, 102], [101, 3899, 102]])
        packed = await embed(bus, SENTENCES, encoding_format="base64")
        short = await embed(bus, SENTENCES, dimensions=64)
    assert len(one.data) == 1 and len(one.data[0].vector) == 384  # type: ignore[arg-type]
    assert [item.index for item in many.data] == list(range(len(SENTENCES)))
    assert many.data[0].vector == pytest.approx(one.data[0].vector, abs=1e-5)
    assert len(as_tokens.data) == 1 and len(as_token_lists.data) == 2
    assert as_token_lists.data[0].vector == pytest.approx(as_tokens.data[0].vector, abs=1e-5)
    assert many.usage.prompt_tokens > 0 and many.usage.completion_tokens == 0
    for floats, raw in zip(many.data, packed.data, strict=True):
        assert isinstance(raw.vector, bytes)
        assert list(struct.unpack(f"<{len(raw.vector) // 4}f", raw.vector)) == pytest.approx(floats.vector, abs=1e-6)
    for item in short.data:
        vector = torch.tensor(item.vector)
        assert vector.shape == (64,) and abs(vector.norm().item() - 1.0) < 1e-4
    similar = torch.tensor(many.data[0].vector) @ torch.tensor(many.data[1].vector)
    unrelated = torch.tensor(many.data[0].vector) @ torch.tensor(many.data[2].vector)
    assert similar > unrelated + 0.2


async def test_bad_embedding_inputs_get_typed_errors_and_the_worker_keeps_serving(bus: Bus) -> None:
    cases = [
        ({"inputs": ""}, ErrorCode.INVALID_REQUEST),
        ({"inputs": ["fine", ""]}, ErrorCode.INVALID_REQUEST),
        ({"inputs": ["a"] * 100_000}, ErrorCode.INVALID_REQUEST),
        ({"inputs": "x " * 600}, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
        ({"inputs": "fine", "dimensions": 385}, ErrorCode.INVALID_REQUEST),
    ]
    async with running_workers(bus, specs(), model=EMBEDDING_MODEL, mode=ServingMode.EMBEDDING):
        for case, code in cases:
            fields = {k: v for k, v in case.items() if k != "inputs"}
            with pytest.raises(RemoteError) as raised:
                await embed(bus, case["inputs"], **fields)
            assert raised.value.code == code, (case if len(str(case)) < 200 else "100k inputs", raised.value.frame.message)
        with pytest.raises(ValueError):  # wrong types never leave the client: the schema refuses them
            await embed(bus, [1.5, "x"])
        assert len((await embed(bus, "still serving")).data) == 1


async def test_embeddings_through_the_gateway_with_the_openai_sdk(bus: Bus) -> None:
    async with running_workers(bus, specs(), model=EMBEDDING_MODEL, mode=ServingMode.EMBEDDING):
        async with serving(client_of(bus), GatewayOptions(host="127.0.0.1", port=0)) as port:
            sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            floats = await sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES)
            packed = await sdk.embeddings.create(model=EMBEDDING_MODEL, input=SENTENCES[:2], encoding_format="base64")
            short = await sdk.embeddings.create(model=EMBEDDING_MODEL, input="hello", dimensions=32)
            with pytest.raises(openai.BadRequestError):
                await sdk.embeddings.create(model=EMBEDDING_MODEL, input="hello", dimensions=1000)
            await sdk.close()
    assert len(floats.data) == len(SENTENCES) and len(floats.data[0].embedding) == 384
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    # The SDK decodes base64 itself when it asked for floats; asked for base64, it hands the string back.
    raw = packed.data[0].embedding
    decoded = struct.unpack("<384f", base64.b64decode(raw)) if isinstance(raw, str) else raw
    assert list(decoded) == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert len(short.data[0].embedding) == 32


async def test_conveyor_embed_prints_vectors_from_worker_processes(bus: Bus) -> None:
    url = bus.nats_settings.urls[0]
    async with worker_processes([url], bus.settings.namespace, ["processor", "embed"], engine="torch",
                                CONVEYOR_MODEL=EMBEDDING_MODEL):
        done = await run_cli_when_served(url, bus.settings.namespace, "embed", "a cat", "a dog", "--dimensions", "64")
    assert done.returncode == 0, done.stderr.decode()
    lines = [json.loads(line) for line in done.stdout.decode().splitlines()]
    assert [line["index"] for line in lines] == [0, 1] and all(line["dimensions"] == 64 for line in lines)
    assert abs(sum(value * value for value in lines[0]["embedding"]) - 1.0) < 1e-4
