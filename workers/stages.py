"""Building a stage from command-line choices: which engine, which role, which models."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from bus.pools import PoolsConfig
from bus.router import RouterOptions
from workers.decode import DecodeStage, MigrationPolicy
from workers.embed import EmbedStage, TorchEmbedder
from workers.engines.torch_engine.image_diffusion import is_image_model
from workers.image import ImageStage, ImageStorage
from workers.encode import EncodeStage
from workers.media import ImageInputs, MediaEncoder, MediaLimits
from workers.engines.torch_engine.vision import placeholder_id
from workers.engines.factory import EngineKind, create_engine, load_tokenizer
from workers.engines.protocol import DisaggregationRole
from workers.engines.qwen_vl import QwenVisionTower, image_tokens, is_qwen_vl
from workers.prefill import PrefillStage
from workers.processor import ProcessorStage, ServedModel
from workers.runtime import PipelineStage
from schemas.registry import ServingMode, Stage

MOCK_CONTEXT_LENGTH = 8192


def build_stage(stage: Stage, kind: EngineKind, models: list[str], mode: ServingMode, load_format: str,
                migration: MigrationPolicy | None = None, router: RouterOptions = RouterOptions(),
                image_storage: ImageStorage | None = None, pools: PoolsConfig | None = None,
                kv_events: bool = True) -> PipelineStage:
    if stage == Stage.PROCESSOR:
        # Image requests need no model here (the image workers' pipelines tokenize their own prompts).
        return ProcessorStage({name: served_model(kind, name) for name in models if not is_image_model(name)}, router,
                              pools)
    if len(models) != 1:
        raise ValueError(f"a {stage.value} worker serves exactly one model (got {len(models)})")
    model = models[0]
    if stage == Stage.ENCODE:
        return _encode_stage(kind, model)
    if stage == Stage.EMBED:
        return _embed_stage(kind, model, load_format)
    if stage == Stage.IMAGE:
        return image_stage(kind, model, image_storage or default_image_storage())
    if stage == Stage.PREFILL:
        return PrefillStage(create_engine(kind, model, DisaggregationRole.PREFILL, load_format, kv_events), model,
                            _image_inputs(kind, model, Stage.PREFILL))
    if stage == Stage.DECODE:
        disaggregated = mode in (ServingMode.DISAGGREGATED, ServingMode.ENCODE_DISAGGREGATED)
        role = DisaggregationRole.DECODE if disaggregated else DisaggregationRole.NONE
        # Disaggregated, the images come as the prompt's KV; the vision path is for a prompt this engine runs
        # itself (its prefill worker died, or the request migrated here).
        images = _image_inputs(kind, model, Stage.DECODE)
        return DecodeStage(create_engine(kind, model, role, load_format, kv_events), model, images, migration or MigrationPolicy())
    raise ValueError(f"the {stage.value} stage is not built yet (see the README's status table)")


def _media_encoder(kind: EngineKind, model: str) -> MediaEncoder | None:
    """The model's vision path: the torch engine's seeded tower, a Qwen2-VL-family tower for SGLang; None for a
    model without one here."""
    if kind == EngineKind.SGLANG:
        model_dir = Path(model)
        config = json.loads((model_dir / "config.json").read_text())
        return MediaEncoder(QwenVisionTower(model_dir, config), MediaLimits()) if is_qwen_vl(config) else None
    if kind != EngineKind.TORCH:
        return None
    from workers.engines.torch_engine.loader import ModelConfig, resolve_model
    from workers.engines.torch_engine.vision import SeededImageTower, VisionConfig, build_vision_tower

    model_dir = resolve_model(model)
    config = ModelConfig.from_dir(model_dir)
    tower = build_vision_tower(VisionConfig(), config.hidden_size, model_dir)
    return MediaEncoder(SeededImageTower(tower, config.vocab_size), MediaLimits())


def _image_inputs(kind: EngineKind, model: str, stage: Stage) -> ImageInputs:
    return ImageInputs(_media_encoder(kind, model), reader_name=f"{stage.value}-images-{uuid.uuid4().hex[:12]}")


def _embed_stage(kind: EngineKind, model: str, load_format: str = "auto") -> EmbedStage:
    if kind == EngineKind.SGLANG:
        from workers.engines.sglang_engine import SGLangEmbedder

        return EmbedStage(SGLangEmbedder(model, load_format), model)
    if kind != EngineKind.TORCH:
        raise ValueError(f"embedding workers run the torch or sglang engine (got {kind.value})")
    from workers.engines.torch_engine.embedding import SentenceEmbedder
    from workers.engines.torch_engine.loader import resolve_model

    return EmbedStage(TorchEmbedder(SentenceEmbedder(resolve_model(model))), model)


def image_stage(kind: EngineKind, model: str, storage: ImageStorage) -> ImageStage:
    if kind != EngineKind.TORCH:
        raise ValueError(f"image workers run diffusers on torch here (got --engine {kind.value}); use --engine torch")
    from workers.engines.torch_engine.image_diffusion import ImageGenerator, resolve_image_model

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return ImageStage(ImageGenerator(resolve_image_model(model), device), model, storage)


def default_image_storage() -> ImageStorage:
    """`response_format: url` images in a local directory unless told (`--image-storage-url`)."""
    return ImageStorage(url=(Path.home() / ".cache" / "conveyor" / "images").as_uri())


def _encode_stage(kind: EngineKind, model: str) -> EncodeStage:
    encoder = _media_encoder(kind, model)
    if encoder is None:
        raise ValueError(f"no vision encoder for {model!r} on the {kind.value} engine: encode workers run the torch "
                         "engine's models, or Qwen2-VL / Qwen2.5-VL models with --engine sglang")
    limits = encoder.limits
    return EncodeStage(encoder, model, served_model(kind, model).context_length, export_pool_bytes=limits.export_pool_bytes)


def served_model(kind: EngineKind, model: str) -> ServedModel:
    """A model as the processor sees it: tokenizer, context length, EOS ids."""
    tokenizer = load_tokenizer(kind, model)
    if kind == EngineKind.MOCK:
        from workers.engines.mock import MockEngineConfig

        return ServedModel(model, tokenizer, MOCK_CONTEXT_LENGTH, (tokenizer.eos_token_id,),
                           vocab_size=MockEngineConfig().vocab_size)
    from workers.engines.torch_engine.embedding import is_embedding_model
    from workers.engines.torch_engine.loader import ModelConfig, eos_token_ids, resolve_model

    model_dir = resolve_model(model)
    raw = json.loads((model_dir / "config.json").read_text())
    if is_embedding_model(model_dir):
        return ServedModel(model, tokenizer, raw["max_position_embeddings"], (), vocab_size=raw.get("vocab_size"))
    if kind != EngineKind.TORCH:
        # SGLang runs architectures the torch engine does not: only what the processor needs is read.
        return ServedModel(model, tokenizer, raw.get("max_position_embeddings", 4096), eos_token_ids(model_dir, raw),
                           image_tokens=image_tokens(raw) if is_qwen_vl(raw) else None, vocab_size=raw.get("vocab_size"))
    config = ModelConfig.from_dir(model_dir)
    # Torch-engine models take images (the seeded vision tower; see torch_engine/vision.py).
    return ServedModel(model, tokenizer, config.max_position_embeddings, config.eos_token_ids,
                       image_tokens=(placeholder_id(config.vocab_size),),
                       vocab_size=config.vocab_size)
