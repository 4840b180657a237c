"""Prefill in one process, decode in another, the prompt's KV read over NIXL (UCX, host memory):
the decode engine's output equals the same request run aggregated."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import IO

import pytest

from schemas.replies import FinishReason
from schemas.sampling import SamplingOptions, StopConditions
from schemas.tasks import BootstrapInfo
from workers.engines.protocol import DisaggregationRole, GenerateRequest, TransferFailed
from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig


REPO_ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingOptions(temperature=0.0)
STOP = StopConditions(max_tokens=24)

PREFILL_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from schemas.sampling import SamplingOptions, StopConditions
    from schemas.tasks import BootstrapInfo
    from workers.engines.protocol import DisaggregationRole, GenerateRequest, TransferFailed
    from workers.engines.torch_engine.engine import TorchEngine, TorchEngineConfig

    async def main() -> None:
        jobs = json.loads(sys.argv[1])
        engine = TorchEngine(TorchEngineConfig(role=DisaggregationRole.PREFILL, max_step_tokens=64))
        await engine.start()
        print("ready", engine.bootstrap_endpoint.port, flush=True)

        async def prefill(room: int, token_ids: list[int]) -> str:
            info = BootstrapInfo(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=room)
            request = GenerateRequest(f"p{room}", token_ids, SamplingOptions(temperature=0.0),
                                      StopConditions(max_tokens=24), bootstrap=info)
            outputs = [output async for output in engine.generate(request)]
            return outputs[-1].finish_reason.value

        reasons = await asyncio.gather(*(prefill(room, ids) for room, ids in jobs))
        print("done", " ".join(reasons), engine.load().kv_used_blocks, flush=True)
        await engine.shutdown()

    asyncio.run(main())
    """
)


def read_line_starting(stream: IO[str], word: str) -> str:
    """The prefill process's next line that starts with `word` (it also logs to stdout)."""
    for line in stream:
        if line.startswith(word):
            return line
    raise AssertionError(f"prefill process ended before printing {word!r}")


async def collect(engine: TorchEngine, request: GenerateRequest) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    async for output in engine.generate(request):
        tokens += output.token_ids
        if output.finished:
            return tokens, output.finish_reason
    raise AssertionError("no finished output")


async def test_decode_engine_continues_from_kv_read_over_nixl_with_identical_output() -> None:
    decode = TorchEngine(TorchEngineConfig(role=DisaggregationRole.DECODE))
    await decode.start()
    prompts = [decode.tokenizer(text).input_ids for text in (
        "The history of the Roman Empire begins with",  # short: one partial block
        "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
        "synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves",
    )]
    jobs = [[1000 + index, ids] for index, ids in enumerate(prompts)]
    prefill = subprocess.Popen(
        [sys.executable, "-c", PREFILL_SCRIPT, json.dumps(jobs)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert prefill.stdout is not None
        ready = await asyncio.to_thread(read_line_starting, prefill.stdout, "ready")
        port = int(ready.split()[1])
        disaggregated = await asyncio.gather(*(
            collect(decode, GenerateRequest(f"d{room}", ids, GREEDY, STOP,
                                            bootstrap=BootstrapInfo(bootstrap_host="127.0.0.1", bootstrap_port=port,
                                                                    bootstrap_room=room)))
            for room, ids in jobs
        ))
        done = (await asyncio.to_thread(read_line_starting, prefill.stdout, "done")).split()
        assert done[0] == "done" and done[-1] == "0", done  # prefill freed every block once read
    finally:
        prefill.kill()
        prefill.wait()
    assert decode.load().kv_used_blocks == 0
    await decode.shutdown()

    aggregated_engine = TorchEngine(TorchEngineConfig())
    await aggregated_engine.start()
    try:
        for (room, ids), (tokens, reason) in zip(jobs, disaggregated, strict=True):
            expected, expected_reason = await collect(aggregated_engine, GenerateRequest(f"a{room}", ids, GREEDY, STOP))
            assert tokens == expected and reason == expected_reason
    finally:
        await aggregated_engine.shutdown()


async def test_decode_fails_clearly_when_the_prefill_never_offers_the_room() -> None:
    decode = TorchEngine(TorchEngineConfig(role=DisaggregationRole.DECODE, handoff_timeout_s=0.5))
    await decode.start()
    try:
        request = GenerateRequest("lost", [1, 2, 3], GREEDY, STOP,
                                  bootstrap=BootstrapInfo(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=7))
        with pytest.raises(TransferFailed, match="unreachable"):
            await collect(decode, request)
        assert decode.load().kv_used_blocks == 0
    finally:
        await decode.shutdown()
