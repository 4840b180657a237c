"""A diffusion language model (LLaDA-style masked diffusion) behind the engine protocol.

A dLLM is a Llama-shaped transformer whose attention is bidirectional and whose vocabulary has one more
token, the mask. Generation (LLaDA, Nie et al. 2025, Algorithm "low-confidence remasking", run
semi-autoregressively): the answer starts as `max_tokens` mask tokens after the prompt and is filled
block by block (`block_length` tokens); within a block, each denoising step predicts every masked
position of the block at once and keeps the most confident predictions — `ceil(masked / steps left)`
of them, or, with `threshold` (Fast-dLLM's parallel decoding, SGLang's `LowConfidence` algorithm),
every prediction at least that confident (and never fewer than that share) — the rest stay masked for the next step.
A finished block is final: its tokens stream to the client as one delta, so a client sees ordinary
token chunks, a block at a time. The first EOS ends the answer (LLaDA pads with EOS); stop strings and
stop tokens end it as in the autoregressive engines. Cancel and abort take effect between steps.

The answer's length is fixed before the first step, so it is capped at `max_new_tokens` whatever
`max_tokens` says (the processor fills `max_tokens` with the whole context when a client gives none).

The model runs on `CausalLM` (model.py) with a full attention mask and a scratch KV cache the size of
the sequence: LLaDA's architecture is Llama's without the causal mask. `tiny-llada-seeded`, the default,
is built from a config with a fixed seed (no dLLM ships in an installable package) with SmolLM2's
tokenizer; its answers are words, not sense. A LLaDA-format directory (`"architectures":
["LLaDAModelLM"]` and a `mask_token_id` in config.json) loads the same way.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.registry import BootstrapEndpoint
from schemas.replies import FinishReason
from workers.engines.detokenizer import IncrementalDetokenizer
from workers.engines.protocol import (
    EngineInfo,
    EngineLoad,
    ExpertRecording,
    GenerateOutput,
    GenerateRequest,
    KvEventBatchOut,
    MemoryTag,
    UnsupportedOption,
)
from workers.engines.torch_engine.loader import ModelConfig, built_once, bundled_smollm2, load_state_dict
from workers.engines.torch_engine.model import CausalLM, StepInputs

SEEDED_DLLM = "tiny-llada-seeded"
DLLM_ARCHITECTURE = "LLaDAModelLM"
_SEED = 4242


class DiffusionSettings(BaseSettings):
    """How a dLLM denoises (`CONVEYOR_DLLM_*`), SGLang's `--dllm-algorithm` settings in our names."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_DLLM_", frozen=True)

    # Tokens filled per block; a finished block streams as one chunk.
    block_length: int = Field(default=32, ge=1)
    # Denoising steps per block (block_length ÷ steps tokens are kept per step, without a threshold).
    steps_per_block: int = Field(default=32, ge=1)
    # Keep every prediction at least this confident each step (never fewer than the fixed share); None: the share.
    threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=256, ge=1)


def is_diffusion_model(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    return DLLM_ARCHITECTURE in (config.get("architectures") or [])


def seeded_dllm_dir() -> Path:
    """`tiny-llada-seeded`: a 2-layer LLaDA-shaped model with seeded weights and SmolLM2's tokenizer."""
    return built_once(SEEDED_DLLM, "model.safetensors", _write_seeded_dllm)


def _write_seeded_dllm(directory: Path) -> None:
    from safetensors.torch import save_file

    source = bundled_smollm2()
    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    text_vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = {
        "architectures": [DLLM_ARCHITECTURE], "model_type": "llama", "vocab_size": text_vocab + 1,
        "mask_token_id": text_vocab, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(_SEED)
    model = CausalLM(ModelConfig.from_dir(directory))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"))


@dataclass(slots=True)
class _Denoising:
    """One request's sequence: the prompt, then the answer being unmasked."""

    tokens: torch.Tensor  # [prompt + answer]
    generator: torch.Generator | None
    temperature: float


class DiffusionLMEngine:
    """One dLLM; requests take turns step by step on one thread (a step is one forward pass)."""

    def __init__(self, model_dir: Path, model_name: str, settings: DiffusionSettings = DiffusionSettings(),
                 device: str = "cpu") -> None:
        self._model_dir = model_dir
        self._settings = settings
        self._device = torch.device(device)
        self._model: CausalLM | None = None
        self._config: ModelConfig | None = None
        self.tokenizer = None
        self.mask_token_id = -1
        self._info = EngineInfo(name="torch-dllm", model=model_name, context_length=0)
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        # One forward pass at a time; requests interleave between steps.
        self._step_lock = threading.Lock()
        self._stopped = asyncio.Event()

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def bootstrap_endpoint(self) -> BootstrapEndpoint | None:
        return None

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from transformers import AutoTokenizer

        raw = json.loads((self._model_dir / "config.json").read_text())
        if "mask_token_id" not in raw:
            raise ValueError(f"{self._model_dir}: a diffusion LM's config.json names its mask_token_id")
        self.mask_token_id = int(raw["mask_token_id"])
        self._config = ModelConfig.from_dir(self._model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        model = CausalLM(self._config)
        model.load_weights(load_state_dict(self._model_dir))
        self._model = model.to(self._device).eval()
        self._info = EngineInfo(name="torch-dllm", model=self._info.model, context_length=self._config.max_position_embeddings,
                                eos_token_ids=self._config.eos_token_ids)

    async def shutdown(self) -> None:
        self._stopped.set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self._check_supported(request)
        assert self._config is not None
        room = self._info.context_length - len(request.token_ids)
        num_new = min(request.stop.max_tokens or room, room, self._settings.max_new_tokens)
        state = self._new_state(request, num_new)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.stop.stop, request.output.skip_special_tokens)
        ends = {*request.stop.stop_token_ids, *(() if request.stop.ignore_eos else self._config.eos_token_ids)}
        answer: list[int] = []
        self._running.add(request.request_id)
        try:
            for start in range(len(request.token_ids), len(request.token_ids) + num_new, self._settings.block_length):
                end = min(start + self._settings.block_length, len(request.token_ids) + num_new)
                if not await self._fill_block(request.request_id, state, start, end):
                    yield self._final(FinishReason.CANCELLED, request, answer)
                    return
                block = state.tokens[start:end].tolist()
                stop_at = _first_end(block, ends, min_index=request.stop.min_tokens - len(answer))
                block = block if stop_at is None else block[: stop_at + 1]
                answer += block
                yield GenerateOutput(token_ids=block, text=detokenizer.add(block))
                if detokenizer.matched_stop is not None or stop_at is not None:
                    matched = detokenizer.matched_stop if detokenizer.matched_stop is not None else block[-1]
                    yield self._final(FinishReason.STOP, request, answer, matched)
                    return
            yield GenerateOutput(token_ids=[], text=detokenizer.flush())
            yield self._final(FinishReason.LENGTH, request, answer)
        finally:
            self._running.discard(request.request_id)
            self._aborted.discard(request.request_id)

    def _final(self, reason: FinishReason, request: GenerateRequest, answer: list[int],
               matched: str | int | None = None) -> GenerateOutput:
        return GenerateOutput(token_ids=[], finish_reason=reason, prompt_tokens=len(request.token_ids),
                              completion_tokens=len(answer), matched_stop=matched)

    async def _fill_block(self, request_id: str, state: _Denoising, start: int, end: int) -> bool:
        """Denoise [start, end) until no mask is left; False when the request was aborted meanwhile."""
        for step in range(self._settings.steps_per_block):
            if request_id in self._aborted or self._stopped.is_set():
                return False
            masked = int((state.tokens[start:end] == self.mask_token_id).sum())
            if masked == 0:
                return True
            steps_left = self._settings.steps_per_block - step
            await asyncio.to_thread(self._step, state, start, end, math.ceil(masked / steps_left))
        return not bool((state.tokens[start:end] == self.mask_token_id).any())

    @torch.inference_mode()
    def _step(self, state: _Denoising, start: int, end: int, num_to_keep: int) -> None:
        """One forward pass over the whole sequence; unmask the block's most confident predictions."""
        assert self._model is not None
        positions = torch.nonzero(state.tokens[start:end] == self.mask_token_id).flatten() + start
        with self._step_lock:
            logits = self._model(_full_attention(state.tokens, positions), self._scratch_cache(len(state.tokens)))
        logits[:, self.mask_token_id] = float("-inf")
        probabilities = torch.softmax(logits, dim=-1)
        if state.temperature > 0:
            tempered = torch.softmax(logits / state.temperature, dim=-1)
            predicted = torch.multinomial(tempered, 1, generator=state.generator).flatten()
        else:
            predicted = probabilities.argmax(dim=-1)
        confidence = probabilities.gather(1, predicted[:, None]).flatten()
        if self._settings.threshold is not None:
            # Every prediction above the threshold, and never fewer than the share that finishes the block in time.
            num_to_keep = max(num_to_keep, int((confidence >= self._settings.threshold).sum()))
        keep = confidence.topk(min(num_to_keep, len(positions))).indices
        state.tokens[positions[keep]] = predicted[keep]

    def _scratch_cache(self, num_tokens: int) -> torch.Tensor:
        assert self._config is not None
        config = self._config
        return torch.empty((config.num_layers, 2, num_tokens, config.num_kv_heads, config.head_dim), device=self._device)

    def _new_state(self, request: GenerateRequest, num_new: int) -> _Denoising:
        tokens = torch.tensor([*request.token_ids, *([self.mask_token_id] * num_new)], dtype=torch.long)
        seed = request.sampling.seed
        return _Denoising(tokens=tokens,
                          generator=torch.Generator().manual_seed(seed) if seed is not None else None,
                          temperature=request.sampling.temperature or 0.0)

    def _check_supported(self, request: GenerateRequest) -> None:
        if request.sampling.n != 1:
            raise UnsupportedOption("the diffusion LM engine generates one completion per request (n=1)")
        if request.guided is not None or request.lora_name is not None or request.session is not None:
            raise UnsupportedOption("the diffusion LM engine has no guided decoding, LoRA adapters or sessions")
        if request.image_rows is not None or request.bootstrap is not None:
            raise UnsupportedOption("the diffusion LM engine takes text prompts in aggregated mode only")
        if request.output.logprobs:
            raise UnsupportedOption("the diffusion LM engine returns no logprobs")
        if len(request.token_ids) >= self._info.context_length:
            raise UnsupportedOption(f"prompt of {len(request.token_ids)} tokens leaves no room in the context of "
                                    f"{self._info.context_length}")

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        raise UnsupportedOption("the diffusion LM engine does not embed")

    def load(self) -> EngineLoad:
        # No KV cache between steps: every step recomputes the sequence.
        return EngineLoad(running_requests=len(self._running), waiting_requests=0, kv_block_size=1,
                          kv_total_blocks=0, kv_used_blocks=0)

    async def kv_events(self) -> AsyncIterator[KvEventBatchOut]:
        """None: nothing is cached between steps, so there is nothing for a router to find."""
        await self._stopped.wait()
        return
        yield  # an async generator that ends at shutdown

    async def release_memory(self, tags: list[MemoryTag]) -> None:
        raise UnsupportedOption("the diffusion LM engine does not release memory")

    async def resume_memory(self, tags: list[MemoryTag]) -> None:
        raise UnsupportedOption("the diffusion LM engine does not release memory")

    async def start_profile(self, output_dir: Path) -> None:
        raise UnsupportedOption("profiling is not wired for the diffusion LM engine")

    async def stop_profile(self) -> None:
        raise UnsupportedOption("profiling is not wired for the diffusion LM engine")

    async def update_weights_from_disk(self, model_path: Path) -> None:
        raise UnsupportedOption("the diffusion LM engine does not update weights in place")

    async def flush_cache(self) -> None:
        return None  # nothing is cached

    async def load_lora(self, name: str, path: str) -> None:
        raise UnsupportedOption("the diffusion LM engine has no LoRA adapters")

    async def unload_lora(self, name: str) -> None:
        return None  # nothing is loaded

    def loras(self) -> dict[str, str]:
        return {}

    async def record_experts(self, action: ExpertRecording) -> None:
        raise UnsupportedOption("the diffusion LM engine has no mixture-of-experts layers to record")


def _full_attention(tokens: torch.Tensor, logit_positions: torch.Tensor) -> StepInputs:
    """One sequence, every token attending to every other, logits at `logit_positions`."""
    num_tokens = len(tokens)
    everything = torch.arange(num_tokens)
    return StepInputs(
        token_ids=tokens, positions=everything, slot_mapping=everything, query_index=everything[None, :],
        query_valid=torch.ones(1, num_tokens, dtype=torch.bool), context_slots=everything[None, :],
        attention_mask=torch.ones(1, 1, num_tokens, num_tokens, dtype=torch.bool), last_index=logit_positions,
    )


def _first_end(block: list[int], ends: set[int], min_index: int) -> int | None:
    """Index of the first token in the block that ends the answer (not before `min_index`)."""
    for index, token in enumerate(block):
        if token in ends and index >= min_index:
            return index
    return None
