"""Building a stage from command-line choices: which engine, which role, which models."""

from __future__ import annotations

from workers.decode import DecodeStage
from workers.engines.factory import EngineKind, create_engine, load_tokenizer
from workers.engines.protocol import DisaggregationRole
from workers.prefill import PrefillStage
from workers.processor import ProcessorStage, ServedModel
from workers.runtime import PipelineStage
from schemas.registry import ServingMode, Stage

MOCK_CONTEXT_LENGTH = 8192


def build_stage(stage: Stage, kind: EngineKind, models: list[str], mode: ServingMode, load_format: str) -> PipelineStage:
    if stage == Stage.PROCESSOR:
        return ProcessorStage({name: served_model(kind, name) for name in models})
    if len(models) != 1:
        raise ValueError(f"a {stage.value} worker serves exactly one model (got {len(models)})")
    model = models[0]
    if stage == Stage.PREFILL:
        return PrefillStage(create_engine(kind, model, DisaggregationRole.PREFILL, load_format), model)
    if stage == Stage.DECODE:
        role = DisaggregationRole.DECODE if mode == ServingMode.DISAGGREGATED else DisaggregationRole.NONE
        return DecodeStage(create_engine(kind, model, role, load_format), model)
    raise ValueError(f"the {stage.value} stage is not built yet (see the README's status table)")


def served_model(kind: EngineKind, model: str) -> ServedModel:
    """A model as the processor sees it: tokenizer, context length, EOS ids."""
    tokenizer = load_tokenizer(kind, model)
    if kind == EngineKind.MOCK:
        return ServedModel(model, tokenizer, MOCK_CONTEXT_LENGTH, (tokenizer.eos_token_id,))
    from workers.engines.torch_engine.loader import ModelConfig, resolve_model

    config = ModelConfig.from_dir(resolve_model(model))
    return ServedModel(model, tokenizer, config.max_position_embeddings, config.eos_token_ids)
