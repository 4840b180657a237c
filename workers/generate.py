"""`conveyor generate`: one request through an engine in this process, streamed to the terminal."""

from __future__ import annotations

import sys
import time
import uuid

from schemas.sampling import SamplingOptions, StopConditions
from workers.engines.factory import EngineKind, create_engine, load_tokenizer
from workers.engines.protocol import GenerateRequest


async def run_generate(kind: EngineKind, model: str | None, prompt: str, max_tokens: int, temperature: float,
                       seed: int | None, raw: bool) -> None:
    print(f"[conveyor] starting the {kind.value} engine ...", file=sys.stderr, flush=True)
    started_s = time.perf_counter()
    tokenizer = load_tokenizer(kind, model)
    engine = create_engine(kind, model)
    await engine.start()
    print(f"[conveyor] engine ready in {time.perf_counter() - started_s:.1f} s", file=sys.stderr, flush=True)
    try:
        token_ids = _prompt_ids(tokenizer, prompt, raw)
        request = GenerateRequest(
            request_id=f"generate-{uuid.uuid4().hex[:8]}",
            token_ids=token_ids,
            sampling=SamplingOptions(temperature=temperature, seed=seed),
            stop=StopConditions(max_tokens=max_tokens),
        )
        sent_s = time.perf_counter()
        first_token_s: float | None = None
        async for output in engine.generate(request):
            if first_token_s is None and output.token_ids:
                first_token_s = time.perf_counter() - sent_s
            print(output.text, end="", flush=True)
            if output.finished:
                elapsed_s = time.perf_counter() - sent_s
                print()
                rate = output.completion_tokens / elapsed_s if elapsed_s else 0.0
                print(
                    f"[conveyor] {output.finish_reason.value if output.finish_reason else '?'}: "
                    f"{output.prompt_tokens} prompt + {output.completion_tokens} completion tokens, "
                    f"TTFT {1000 * (first_token_s or 0):.0f} ms, {rate:.1f} tokens/s",
                    file=sys.stderr,
                )
    finally:
        await engine.shutdown()


def _prompt_ids(tokenizer: object, prompt: str, raw: bool) -> list[int]:
    if raw:
        return list(tokenizer.encode(prompt))  # type: ignore[attr-defined]
    ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
