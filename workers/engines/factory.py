"""Choosing an engine by name, and the tokenizer that goes with its model."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers.engines.protocol import DisaggregationRole, Engine


class TorchEngineSettings(BaseSettings):
    """Where and how large a torch engine `conveyor worker` starts: from CONVEYOR_TORCH_* variables."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_TORCH_", frozen=True)

    # "auto": CUDA when available, else CPU.
    device: str = "auto"
    # KV cache size in tokens: what the prefix cache and running requests share.
    kv_cache_tokens: int = Field(default=16384, gt=0)
    max_running_requests: int = Field(default=64, gt=0)
    # Token budget of one step; longer prompts are prefilled in chunks.
    max_step_tokens: int = Field(default=512, gt=0)
    # Where a prefill engine serves its KV handoff: 0.0.0.0 when decode workers run on other hosts or containers
    # (it then advertises this host's address).
    bootstrap_host: str = "127.0.0.1"


class EngineKind(StrEnum):
    TORCH = "torch"  # the embedded default (CPU or CUDA)
    MOCK = "mock"  # simulated timing, for benchmarks of the pipeline
    SGLANG = "sglang"  # the production GPU engine (optional extra)


def create_engine(kind: EngineKind, model: str | None, role: DisaggregationRole = DisaggregationRole.NONE,
                  load_format: str = "auto", kv_events: bool = True) -> Engine:
    """An engine that is not started yet; `await engine.start()` loads it. `kv_events=False`: SGLang records no KV
    events at all (the torch and mock engines keep theirs internal; the worker publishes none either way)."""
    if kind == EngineKind.TORCH:
        from workers.engines.torch_engine.diffusion_lm import DiffusionLMEngine, is_diffusion_model
        from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig
        from workers.engines.torch_engine.loader import DEFAULT_MODEL, resolve_model

        model_dir = resolve_model(model or DEFAULT_MODEL)
        if is_diffusion_model(model_dir):
            if role != DisaggregationRole.NONE:
                raise ValueError("a diffusion LM runs aggregated (prefill and decode are one denoising loop)")
            return DiffusionLMEngine(model_dir, model or DEFAULT_MODEL)
        settings = TorchEngineSettings()
        return TorchEngine(TorchEngineConfig(model=model or DEFAULT_MODEL, role=role, load_format=load_format,
                                             **settings.model_dump()))
    if kind == EngineKind.MOCK:
        from workers.engines.mock import MockEngine, MockEngineConfig

        return MockEngine(MockEngineConfig(model=model or "mock"))
    from workers.engines.sglang_engine import SGLangEngine, SGLangEngineConfig

    if model is None:
        raise ValueError("the sglang engine needs --model: a local Hugging Face directory")
    return SGLangEngine(SGLangEngineConfig(model_path=model, role=role, load_format=load_format, kv_events=kv_events))


class ByteTokenizer:
    """UTF-8 bytes as token ids (offset past the mock's special ids): the mock engine's tokenizer."""

    eos_token_id = 2

    def encode(self, text: str) -> list[int]:
        return [byte + 3 for byte in text.encode()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t - 3 for t in token_ids if 3 <= t < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True) -> list[int]:
        offered = "".join(f"tool: {tool['function']['name']}\n" for tool in tools or [])
        return self.encode(offered + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def load_tokenizer(kind: EngineKind, model: str | None) -> Any:
    """A Hugging Face tokenizer for the model (or the mock's byte tokenizer)."""
    if kind == EngineKind.MOCK:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    from workers.engines.torch_engine.loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))
