"""Turn a step's logits into next tokens, honouring each sequence's sampling options.

Order of operations (as in vLLM and SGLang): penalties on the raw logits, the grammar's mask (guided decoding),
then temperature, then
top-k, top-p and min-p filtering, then a draw from the sequence's own generator (seeded when the
request gave a seed). Temperature 0 is greedy. Log-probabilities are of the unmodified model
distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from schemas.replies import TokenLogprob, TopLogprob
from workers.engines.torch_engine.sequence import Sequence

DEFAULT_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: TokenLogprob | None


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """One token per row of `logits` [B, vocab], for the sequence of the same row."""
    if all(seq.is_greedy and not _has_penalties(seq) and not seq.output.logprobs and seq.grammar is None for seq in seqs):
        return [Sampled(int(token), None) for token in logits.argmax(dim=-1).tolist()]
    return [_sample_row(row, seq) for row, seq in zip(logits, seqs, strict=True)]


def _has_penalties(seq: Sequence) -> bool:
    options = seq.sampling
    return bool(options.frequency_penalty or options.presence_penalty or _below_min_tokens(seq) or
                (options.repetition_penalty is not None and options.repetition_penalty != 1.0))


def _below_min_tokens(seq: Sequence) -> bool:
    return bool(seq.banned_before_min_tokens) and seq.num_completion_tokens < seq.stop.min_tokens


def _sample_row(logits: torch.Tensor, seq: Sequence) -> Sampled:
    raw_logprobs = torch.log_softmax(logits, dim=-1) if seq.output.logprobs else None
    logits = _constrain(_apply_penalties(logits.clone(), seq), logits, seq)
    options = seq.sampling
    temperature = DEFAULT_TEMPERATURE if options.temperature is None else options.temperature
    if temperature == 0.0:
        token = int(logits.argmax())
    else:
        probs = torch.softmax(_filter(logits / temperature, seq), dim=-1)
        token = int(torch.multinomial(probs, 1, generator=seq.generator))
    if seq.grammar is not None:
        seq.grammar.accept(token)
    return Sampled(token, _logprob(raw_logprobs, token, seq.output.top_logprobs) if raw_logprobs is not None else None)


def _constrain(logits: torch.Tensor, raw: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The grammar's mask over the penalized logits. Where it leaves nothing (the grammar wants its end, and EOS is
    banned until min_tokens) the grammar wins: output that parses beats the length asked for."""
    if seq.grammar is None:
        return logits
    masked = seq.grammar.mask(logits)
    return masked if bool(torch.isfinite(masked).any()) else seq.grammar.mask(raw.clone())


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    options = seq.sampling
    if _below_min_tokens(seq):
        logits[list(seq.banned_before_min_tokens)] = float("-inf")
    if options.repetition_penalty is not None and options.repetition_penalty != 1.0:
        # HF/SGLang semantics over prompt and output: shrink positive logits, grow negative ones.
        # Image pad ids lie outside the vocabulary: they have no logit to penalize.
        seen = torch.tensor(sorted({t for t in seq.token_ids if t < logits.shape[0]}), dtype=torch.long)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / options.repetition_penalty, values * options.repetition_penalty)
    if options.frequency_penalty or options.presence_penalty:
        # OpenAI semantics over the output only.
        output = torch.tensor(seq.completion_token_ids, dtype=torch.long)
        if output.numel():
            counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
            logits -= (options.frequency_penalty or 0.0) * counts
            logits -= (options.presence_penalty or 0.0) * (counts > 0).to(logits.dtype)
    return logits


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    options = seq.sampling
    if options.top_k is not None and options.top_k < logits.shape[0]:
        threshold = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if options.top_p is not None and options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= options.top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if options.min_p is not None and options.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < options.min_p * probs.max(), float("-inf"))
    return logits


def _logprob(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top: list[TopLogprob] = []
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        top = [TopLogprob(token_id=int(i), logprob=float(v)) for v, i in zip(values, ids, strict=True)]
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)
