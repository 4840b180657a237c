"""Llama / Qwen2 decoder whose attention reads and writes a paged KV cache.

One forward pass serves a whole step: the tokens of every scheduled sequence are concatenated
(prefill chunks and single decode tokens alike), their K/V are written to their cache slots, and
attention runs once per layer over a padded [sequences × context] view gathered from the cache.
Module and parameter names follow Hugging Face's, so a safetensors state dict loads as is. The projections are
`LoraLinear`s: a step's tokens run with their request's LoRA adapter, if any (lora.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.engines.torch_engine.loader import ModelConfig
from workers.engines.torch_engine.lora import LoraBatch, LoraLinear


@dataclass(frozen=True, slots=True)
class StepInputs:
    """Where each token of a step sits: in the sequence, in the cache, in the padded attention view."""

    token_ids: torch.Tensor  # [T] every scheduled token, sequence after sequence
    positions: torch.Tensor  # [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to
    query_index: torch.Tensor  # [B, max_q] index into the T tokens (padding points at 0)
    query_valid: torch.Tensor  # [B, max_q] False on padding
    context_slots: torch.Tensor  # [B, max_ctx] cache slots of each sequence's context (padding: 0)
    attention_mask: torch.Tensor  # [B, 1, max_q, max_ctx] True where a query may attend
    last_index: torch.Tensor  # [B] index of each sequence's last token this step (for logits)
    # Multimodal: which of the T tokens are image tokens, and the rows that replace their embeddings.
    image_index: torch.Tensor | None = None  # [M]
    image_rows: torch.Tensor | None = None  # [M, hidden]
    # LoRA: the tokens of each adapter (empty when every sequence runs on the base model).
    lora: LoraBatch = ()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = LoraLinear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = LoraLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = LoraLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = LoraLinear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x, step.lora).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x, step.lora).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, step.lora).view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, step.positions)
        # Write first: a sequence's queries attend to the keys written in this same step.
        k_cache.index_copy_(0, step.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, step.slot_mapping, v.to(v_cache.dtype))
        queries = q[step.query_index].transpose(1, 2)  # [B, H, max_q, D]
        keys = k_cache[step.context_slots].transpose(1, 2).to(q.dtype)  # [B, KV, max_ctx, D]
        values = v_cache[step.context_slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=step.attention_mask, enable_gqa=True)
        out = out.transpose(1, 2)[step.query_valid]  # back to [T, H, D] in token order
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim), step.lora)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = LoraLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = LoraLinear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = LoraLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch = ()) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, rotary: Rotary, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x), step.lora)


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if self.config.tie_word_embeddings:
            state = {name: tensor for name, tensor in state.items() if name != "lm_head.weight"}
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [name for name in missing if not (self.config.tie_word_embeddings and name == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    @torch.inference_mode()
    def forward(self, step: StepInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] at each sequence's last token; kv_cache is [layers, 2, slots, kv_heads, head_dim]."""
        if step.image_rows is None:
            x = self.model.embed_tokens(step.token_ids)
        else:
            # Image pad ids lie outside the vocabulary: look up a valid id, then put the image rows there.
            x = self.model.embed_tokens(step.token_ids.clamp(max=self.config.vocab_size - 1))
            x[step.image_index] = step.image_rows.to(x.dtype)
        for index, layer in enumerate(self.model.layers):
            x = layer(x, self.rotary, step, kv_cache[index, 0], kv_cache[index, 1])
        x = self.model.norm(x[step.last_index])
        return self.lm_head(x).float()
