"""The Qwen2-VL path that SGLang deployments use, up to the engine (SGLang itself runs on the GPU machine:
docs/gpu.md): the processor marks each image with the model's vision tokens, the encode worker's tower
gives each image as many rows as its grid says, hands rows and grids on over NIXL, and the SGLang adapter
turns them into the one precomputed item SGLang takes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schemas.codec import decode, encode
from schemas.client import ChatMessage, ChatRequest, ImagePart, MediaUrl, TextPart
from schemas.tasks import EncodedImages, MediaItem
from tests.test_multimodal import BLUE, RED, data_url, png
from workers.engines.factory import EngineKind
from workers.engines.protocol import GenerateRequest, UnsupportedOption
from workers.engines.qwen_vl import QwenVisionTower
from workers.engines.sglang_engine import image_item
from workers.media import ImageInputs
from workers.media_transfer import EmbeddingExporter
from workers.processor import ProcessorStage
from workers.stages import _media_encoder, served_model

REPO_ROOT = Path(__file__).resolve().parents[1]
MERGE = 4  # a 2 x 2 patch merge


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("qwen2vl")
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "tiny_qwen2_vl.py"), str(target)], check=True,
                   cwd=REPO_ROOT)
    return target


def image_request(model: str, urls: list[str]) -> ChatRequest:
    parts = [TextPart(text="Compare:")] + [ImagePart(image_url=MediaUrl(url=url)) for url in urls]
    return ChatRequest(request_id="r", reply_to="_INBOX.r", model=model,
                       messages=[ChatMessage(role="user", content=parts)])  # type: ignore[arg-type]


async def test_qwen_prompt_expands_each_image_to_its_grid_and_the_rows_reach_sglang_in_one_item(qwen_dir: Path) -> None:
    model = served_model(EngineKind.SGLANG, str(qwen_dir))
    assert model.image_tokens is not None
    start, pad, end = model.image_tokens
    wide = data_url(png((20, 200, 20), size=(320, 160)))
    token_ids, media = ProcessorStage({model.name: model})._tokenize(image_request(model.name, [RED, wide]), model)
    assert token_ids.count(pad) == 2 and token_ids.count(start) == 2 and token_ids.count(end) == 2
    assert token_ids[token_ids.index(pad) - 1] == start and token_ids[token_ids.index(pad) + 1] == end

    encoder = _media_encoder(EngineKind.SGLANG, str(qwen_dir))
    assert encoder is not None and encoder.placeholder_id == pad
    encoded = await encoder.encode(token_ids, media)
    assert encoded.grids is not None and encoded.rows is not None
    # Each image's rows: its patch grid t·h·w over the 2 x 2 merge; the wide image has more of them.
    sizes = [t * h * w // MERGE for t, h, w in encoded.grids]
    assert sizes[1] > sizes[0] > 0 and encoded.rows.shape == (sum(sizes), 1536)
    assert encoded.token_ids.count(pad) == sum(sizes)
    assert len(encoded.token_ids) == len(token_ids) - 2 + sum(sizes)

    request = GenerateRequest("r", encoded.token_ids, image_rows=encoded.rows, image_grids=encoded.grids)
    item = image_item(request)
    assert item["format"] == "processor_output" and item["modality"] == "IMAGE"
    assert torch.equal(item["precomputed_embeddings"], encoded.rows)
    assert item["image_grid_thw"].tolist() == [list(grid) for grid in encoded.grids]
    with pytest.raises(UnsupportedOption, match="patch grids"):
        image_item(GenerateRequest("r", encoded.token_ids, image_rows=encoded.rows))


async def test_qwen_tower_is_the_same_in_every_process_and_the_cache_returns_the_same_rows(qwen_dir: Path) -> None:
    item = MediaItem(modality="image", source=MediaUrl(url=BLUE))
    first = _media_encoder(EngineKind.SGLANG, str(qwen_dir))
    other = _media_encoder(EngineKind.SGLANG, str(qwen_dir))
    assert first is not None and other is not None
    placeholder = first.placeholder_id
    fresh = await first.encode([1, placeholder, 2], [item])
    cached = await first.encode([1, placeholder, 2], [item])
    elsewhere = await other.encode([1, placeholder, 2], [item])
    assert first.cache.size_bytes == fresh.rows.numel() * 4  # type: ignore[union-attr]
    assert torch.equal(cached.rows, fresh.rows) and cached.grids == fresh.grids  # type: ignore[arg-type]
    assert torch.allclose(elsewhere.rows, fresh.rows, atol=1e-5)  # type: ignore[arg-type]


async def test_rows_and_grids_cross_nixl_as_the_encode_worker_hands_them_on(qwen_dir: Path) -> None:
    encoder = _media_encoder(EngineKind.SGLANG, str(qwen_dir))
    assert encoder is not None
    items = [MediaItem(modality="image", source=MediaUrl(url=url)) for url in (RED, BLUE)]
    encoded = await encoder.encode([1, encoder.placeholder_id, 2, encoder.placeholder_id], items)
    assert encoded.rows is not None and encoded.grids is not None
    exporter = EmbeddingExporter("encode-qwen-test", 16 << 20)
    try:
        handle = await exporter.offer("req-1", encoded.rows, wait_for_space_s=5, cancelled=lambda: False, hold_s=60)
        # Asked while the offer is open: the exporter's poller may end it (and forget it) before the read returns.
        ended = asyncio.ensure_future(exporter.outcome("req-1"))
        wire = EncodedImages(token_ids=encoded.token_ids, rows=handle, image_grids=list(encoded.grids))
        # What an SGLang LLM worker makes of the task (it has no tower of its own here: only the rows can serve).
        prompt = await ImageInputs(None, reader_name="decode-qwen-test").resolve(
            "req-1", [1, encoder.placeholder_id, 2, encoder.placeholder_id], items,
            decode(encode(wire), EncodedImages))
        assert prompt.token_ids == encoded.token_ids and prompt.grids == encoded.grids
        assert prompt.rows is not None and torch.equal(prompt.rows, encoded.rows)
        assert await ended == "read"
    finally:
        await exporter.close()
