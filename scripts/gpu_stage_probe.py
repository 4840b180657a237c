"""What SGLang 0.5.17 itself does for the embedding and diffusion stages, on the GPU machine, with dummy weights:
the engine alone, before Conveyor is put in front of it (scripts/bench_embed.py --engine sglang does that).

    bash scripts/gpu_run.sh python3 scripts/gpu_stage_probe.py embed --model .gpu/minilm
    bash scripts/gpu_run.sh python3 scripts/gpu_stage_probe.py dllm --model .gpu/sdar
    bash scripts/gpu_run.sh python3 scripts/gpu_stage_probe.py image --model .gpu/tiny-sd-seeded

`embed`: an `is_embedding` engine on a BERT-shaped config (all-MiniLM-L6-v2's), sentences/s at batch 1, 32
and 256. `dllm`: a diffusion LM (SDAR-shaped config: SGLang 0.5.17 knows LLaDA2-MoE and SDAR) with
`dllm_algorithm=LowConfidence`, streamed tokens/s. `image`: SGLang's diffusion runtime (`sglang.multimodal_gen`,
its diffusers backend) on the image worker's seeded pipeline, seconds per image. Each prints one JSON line of results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import traceback

ENGINE_ARGS = {"load_format": "dummy", "attention_backend": "triton", "sampling_backend": "pytorch",
               "mem_fraction_static": 0.3, "log_level": "warning"}


def token_lists(count: int, length: int, vocab: int) -> list[list[int]]:
    return [[101, *((1000 + 37 * i + j) % vocab for j in range(length - 2)), 102] for i in range(count)]


async def embed_rates(engine, vocab: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    async def encode(batch: list[list[int]]) -> list:  # type: ignore[type-arg]
        result = await engine.tokenizer_manager.generate_request(EmbeddingReqInput(input_ids=batch), None).__anext__()
        return result if isinstance(result, list) else [result]

    first = await encode(token_lists(2, 16, vocab))
    rates: dict[str, float] = {"dimensions": len(first[0]["embedding"])}
    for batch_size, rounds in ((1, 200), (32, 20), (256, 5)):
        started = time.perf_counter()
        for round_index in range(rounds):
            await encode(token_lists(batch_size, 16, vocab))
        rates[f"sentences_per_s_batch_{batch_size}"] = batch_size * rounds / (time.perf_counter() - started)
    started = time.perf_counter()
    await asyncio.gather(*(encode(token_lists(1, 16, vocab)) for _ in range(256)))
    rates["sentences_per_s_256_concurrent_singles"] = 256 / (time.perf_counter() - started)
    return rates


async def dllm_rates(engine) -> dict[str, float]:  # type: ignore[no-untyped-def]
    params = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0}
    chunks, tokens = 0, 0
    started = time.perf_counter()
    stream = await engine.async_generate(input_ids=list(range(100, 132)), sampling_params=params, stream=True)
    first_s = None
    async for output in stream:
        first_s = first_s or time.perf_counter() - started
        chunks += 1
        tokens = output["meta_info"]["completion_tokens"]
    one_s = time.perf_counter() - started
    started = time.perf_counter()
    many = await asyncio.gather(*(engine.async_generate(input_ids=list(range(100 + i, 132 + i)), sampling_params=params)
                                  for i in range(16)))
    many_s = time.perf_counter() - started
    return {"chunks": chunks, "completion_tokens": tokens, "first_chunk_s": first_s or 0.0,
            "tokens_per_s_1_stream": tokens / one_s,
            "tokens_per_s_16_requests": sum(o["meta_info"]["completion_tokens"] for o in many) / many_s}


def image_run(model_dir: str) -> dict[str, object]:
    """SGLang's diffusion runtime on a diffusers directory (its `diffusers` backend)."""
    from sglang.multimodal_gen.runtime.entrypoints.diffusion_generator import DiffGenerator

    started = time.perf_counter()
    generator = DiffGenerator.from_pretrained(model_path=model_dir, backend="diffusers", num_gpus=1)
    start_s = time.perf_counter() - started
    timings = []
    for seed in (1, 2, 3):
        started = time.perf_counter()
        output = generator.generate(sampling_params_kwargs={
            "prompt": "a red fox in the snow", "num_inference_steps": 20, "height": 256, "width": 256, "seed": seed,
            "output_path": "/tmp/sglang-images"})
        timings.append(time.perf_counter() - started)
    return {"start_s": start_s, "seconds_per_image_256px_20_steps": sorted(timings)[1], "output": repr(output)[:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probe", choices=["embed", "dllm", "image"])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    result: dict[str, object] = {"probe": args.probe}
    started = time.perf_counter()
    try:
        if args.probe == "image":
            result |= image_run(args.model)
        else:
            import sglang

            # A dLLM's CUDA-graph capture of 58 batch sizes ran past 240 s here: without graphs it starts in a minute.
            extra = ({"is_embedding": True} if args.probe == "embed"
                     else {"dllm_algorithm": "LowConfidence", "disable_cuda_graph": True})
            engine = sglang.Engine(model_path=args.model, **ENGINE_ARGS, **extra)
            result["start_s"] = time.perf_counter() - started
            vocab = json.load(open(f"{args.model}/config.json"))["vocab_size"]
            coroutine = embed_rates(engine, vocab) if args.probe == "embed" else dllm_rates(engine)
            result |= engine.loop.run_until_complete(coroutine)
            engine.shutdown()
    except Exception as error:  # the point is to record what happened
        result["error"] = f"{type(error).__name__}: {error}"
        result["trace_tail"] = traceback.format_exc().splitlines()[-6:]
    print("PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
