"""One engine step on the model: build the step's inputs from the scheduled chunks, run the forward."""

from __future__ import annotations

from bisect import bisect_left

import torch

from workers.engines.torch_engine.model import CausalLM, StepInputs
from workers.engines.torch_engine.scheduler import ScheduledChunk


def build_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_index: list[int] = []
    context_lengths: list[int] = []
    query_lengths: list[int] = []
    image_index: list[int] = []
    image_rows: list[torch.Tensor] = []
    lora_tokens: dict[str, list[int]] = {}
    for chunk in chunks:
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        end = start + chunk.num_tokens
        if seq.lora_name is not None:
            lora_tokens.setdefault(seq.lora_name, []).extend(range(len(token_ids), len(token_ids) + chunk.num_tokens))
        if seq.image_rows is not None:
            first, last = bisect_left(seq.image_positions, start), bisect_left(seq.image_positions, end)
            image_index.extend(len(token_ids) + position - start for position in seq.image_positions[first:last])
            image_rows.append(seq.image_rows[first:last])
        token_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(_slots(seq.block_table, start, end, block_size).tolist())
        last_index.append(len(token_ids) - 1)
        context_lengths.append(end)
        query_lengths.append(chunk.num_tokens)
    num_seqs, max_q, max_ctx = len(chunks), max(query_lengths), max(context_lengths)
    query_index = torch.zeros(num_seqs, max_q, dtype=torch.long)
    query_valid = torch.zeros(num_seqs, max_q, dtype=torch.bool)
    context_slots = torch.zeros(num_seqs, max_ctx, dtype=torch.long)
    query_positions = torch.zeros(num_seqs, max_q, dtype=torch.long)
    offset = 0
    for row, chunk in enumerate(chunks):
        length, context = query_lengths[row], context_lengths[row]
        query_index[row, :length] = torch.arange(offset, offset + length)
        query_valid[row, :length] = True
        query_positions[row, :length] = torch.arange(context - length, context)
        context_slots[row, :context] = _slots(chunk.seq.block_table, 0, context, block_size)
        offset += length
    key_positions = torch.arange(max_ctx)
    # Causal within the context; padded query rows attend to key 0 only, so they stay finite.
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    mask &= key_positions[None, None, :] < torch.tensor(context_lengths)[:, None, None]
    mask |= (~query_valid)[:, :, None] & (key_positions == 0)[None, None, :]
    return StepInputs(
        token_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_index=query_index.to(device),
        query_valid=query_valid.to(device),
        context_slots=context_slots.to(device),
        attention_mask=mask[:, None].to(device),
        last_index=torch.tensor(last_index, dtype=torch.long, device=device),
        image_index=torch.tensor(image_index, dtype=torch.long, device=device) if image_index else None,
        image_rows=torch.cat(image_rows).to(device) if image_index else None,
        lora=tuple((name, torch.tensor(rows, dtype=torch.long, device=device)) for name, rows in lora_tokens.items()),
    )


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, end) of a sequence."""
    positions = torch.arange(start, end)
    return torch.tensor(block_table, dtype=torch.long)[positions // block_size] * block_size + positions % block_size


def run_step(model: CausalLM, chunks: list[ScheduledChunk], kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Logits [len(chunks), vocab] at each chunk's last token."""
    return model(build_inputs(chunks, block_size, kv_cache.device), kv_cache)
