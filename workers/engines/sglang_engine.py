"""`SGLangEngine`: the production engine, an adapter over a real `sglang.Engine` (SGLang 0.5.17).

The only module that imports sglang (with `sglang_events.py`, whose publisher runs inside SGLang's scheduler
processes), and only inside `start()`, so the package stays optional. What it maps, read from the 0.5.17 wheel:

- generation: `Engine.async_generate(input_ids=..., sampling_params=..., stream=True, rid=...)` with
  `incremental_streaming_output=True`, so each item's `output_ids` / `text` are disjoint deltas; the
  item's `meta_info` carries `finish_reason` (`{"type": "stop"|"length"|"abort", "matched": ...}`),
  `prompt_tokens`, `completion_tokens`, `cached_tokens` and, when asked, `output_token_logprobs`;
- disaggregation: `bootstrap_host` / `bootstrap_port` / `bootstrap_room` on the call, with
  `disaggregation_mode` prefill/decode and the NIXL transfer backend on the engine;
- abort: `tokenizer_manager.abort_request(rid=...)` (not an Engine method);
- KV events: `kv_events_config` makes SGLang's scheduler PUB on ZMQ `[topic, seq u64 BE, msgpack
  KVEventBatch]`, where the batch is msgspec `array_like` — `[ts, [events], attn_dp_rank]` — and
  each event a tagged array `["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium]`;
  `KvEventRelay` subscribes and turns them into ours, with our chained block keys in place of SGLang's own hashes
  (a router hashes prompts our way; SGLang's hashes only identify its removals). SGLang publishes on a Unix socket
  of the worker's (`kv_events_endpoint`); a relay that hears nothing while requests finish is logged
  (`SilentEventsWatch`);
- control: the tokenizer manager's async `flush_cache`, `start_profile` / `stop_profile`,
  `update_weights_from_disk`, `release_memory_occupation` / `resume_memory_occupation` (the Engine's
  own wrappers call `run_until_complete`, unusable inside a running loop);
- load: `tokenizer_manager.get_loads()` snapshots (running / waiting requests, used / total tokens), and at
  start `get_internal_state()`'s `effective_max_running_requests_per_dp` (the worker holds no more than that);
- LoRA: `load_lora_adapter` / `unload_lora_adapter` with `LoadLoRAAdapterReqInput` (`enable_lora` at start),
  the adapter's name as `lora_path` on the call; MoE: `start/stop/dump_expert_distribution_record`;
- sessions: `open_session` / `close_session` (`OpenSessionReqInput`), each turn `session_params={"id", "rid"}`
  with the previous finished turn's request id (non-streaming sessions continue from the node they name).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from itertools import takewhile
from pathlib import Path
from typing import Any, Literal

import msgpack
import structlog
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from schemas.kv_hashing import block_hash, iter_chain_hashes
from workers.engines.cpu_pinning import DEFAULT_LOCK_DIR, CpuClaim, parse_cpu_list, pin_schedulers
from workers.engines.detokenizer import Decoder, IncrementalDetokenizer
from workers.engines.network import advertised_host
from workers.engines.pacing import Admission, PrefillBudget, Withdrawn
from schemas.registry import BootstrapEndpoint
from schemas.replies import FinishReason, TokenLogprob, TopLogprob
from workers.engines.events import KvEventFanout
from workers.engines.protocol import (
    DisaggregationRole,
    EngineInfo,
    EngineLoad,
    ExpertRecording,
    GenerateOutput,
    GenerateRequest,
    KvEventBatchOut,
    MemoryTag,
    UnsupportedOption,
    choice_regex,
)
from workers.engines.sglang_events import PUBLISHER_NAME, inline_publisher_engine

log = structlog.get_logger(__name__)

# SGLang builds and sends each running request's output every `stream_interval` decode steps (the first token always
# at once), and its detokenizer and our worker handle each such output. At SGLang's own default of 1 that is every
# token; at 8, on four H200s in one run, the stack gave 1.13-1.18x the tokens it gave at 1 at 1, 64 and 128 streams
# (1.06x at 256; SGLang's own server 1.04-1.17x with the same change) and 16 streams did not move (docs/performance.md,
# forty-seventh stop). The cost: after the first token, text arrives 8 tokens a frame (Dynamo's docs suggest 20).
DEFAULT_STREAM_INTERVAL = 8
# Prefill pacing hands SGLang the next share once the last share's requests have this many tokens: their second
# token means SGLang ran a decode step after their prefill (with a stream interval of N it arrives in the frame of
# tokens 2..N+1, N steps after the prefill). Released at the first token, the next share could reach
# the scheduler in time to be prefilled straight after the last, and on the H100 some rounds kept the 30-38 ms tail.
RELEASE_AFTER_TOKENS = 2


class SGLangEngineConfig(BaseSettings):
    """Read from CONVEYOR_SGLANG_* variables (e.g. CONVEYOR_SGLANG_MEM_FRACTION_STATIC=0.3 to share a GPU)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_SGLANG_", frozen=True)

    model_path: str
    role: DisaggregationRole = DisaggregationRole.NONE
    load_format: str = "auto"
    tp_size: int = 1
    # KV-cache page = KV-event block, in tokens (Dynamo's SGLang examples use 16). At SGLang's own default of 1,
    # it records one KV event per token; on the H100 relaying them took half of the decode worker's event loop.
    page_size: int | None = 16
    mem_fraction_static: float | None = None
    context_length: int | None = None
    # The trimmed sgl-kernel carried to the GPU machine has no FA3 (see docs/gpu.md).
    attention_backend: str | None = "triton"
    # A vision-language model's own vision tower is built even when the rows come precomputed, and SGLang's
    # default attention for it on Hopper is FA3, which the trimmed sgl-kernel does not have.
    mm_attention_backend: str | None = "sdpa"
    sampling_backend: str | None = "pytorch"
    # Decode steps between a running request's outputs (1: every token); see DEFAULT_STREAM_INTERVAL.
    stream_interval: int = Field(default=DEFAULT_STREAM_INTERVAL, ge=1)
    # Prefill pacing (workers/engines/pacing.py): prompt tokens, less what the prefix cache holds, handed to SGLang
    # before the last share's requests have streamed their second token; 0 hands every request over as it arrives.
    # Only an aggregated engine paces (a decode engine's prompts arrive as KV; a prefill engine has no streams to keep
    # decoding).
    # Off by default: on the H100 a budget bounded the 64-stream inter-token tail but cost the first token
    # (docs/performance.md, eleventh stop). 2048 is the measured compromise for a deployment that wants the tail; it
    # was measured at a stream interval of 1 (at 8 a share is released 8 decode steps after its prefill, not 1).
    prefill_budget_tokens: int = Field(default=0, ge=0)
    # SGLang's own Prometheus series (per-token histograms observed on the worker's event loop). Off: the worker's
    # /metrics has its own TTFT, ITL and load series, and on the H100 turning these off (with KV events) took the
    # inter-token gap at 1 stream from 2.38 ms to 1.79 ms (docs/performance.md).
    enable_metrics: bool = False
    # PD disaggregation: bootstrap port of a prefill engine (0 picks a free one) and the transfer.
    bootstrap_port: int = 0
    # SGLang's prefill bootstrap server binds to its `host` (127.0.0.1 by default), and decode engines
    # connect to what we advertise: this address, or this host's own when it is 0.0.0.0. Set a
    # routable address (or 0.0.0.0) when prefill and decode run on different machines.
    bootstrap_host: str = "127.0.0.1"
    transfer_backend: str = "nixl"
    # KV events: SGLang records its cache's changes and publishes them over ZMQ for the relay. Off (`conveyor worker
    # --no-kv-events`): none are recorded, for a worker no KV router reads. The port: 0 publishes on a Unix socket
    # only this user can open (the events carry every prompt's token ids); a port publishes on it, on every
    # interface, for subscribers of one's own beside the relay (`kv_events_endpoint`).
    kv_events: bool = True
    kv_events_port: int = 0
    # What sends the events from SGLang's scheduler process: "inline", ours on the scheduling loop itself; "sglang",
    # SGLang's own publisher thread, slower at 16-256 streams (workers/engines/sglang_events.py says by how much).
    kv_events_publisher: Literal["sglang", "inline"] = "inline"
    enable_memory_saver: bool = False
    # Each SGLang scheduler held on CPUs of its own (workers/engines/cpu_pinning.py): "auto" claims two CPUs in whole
    # cores per scheduler, near its GPU and highest-numbered first, that no other worker sharing the lock directory
    # holds; a CPU list ("14,15", "12-15") gives every scheduler those; "off" leaves it to the kernel. Held, the
    # scheduler's loop waited less for a CPU (1.6% of its time against 4.5% free at 256 streams on the H100:
    # docs/performance.md).
    scheduler_cpus: str = "auto"
    scheduler_cpus_lock_dir: Path = DEFAULT_LOCK_DIR
    # LoRA adapters, loaded at run time (`conveyor lora load`): SGLang sizes its adapter pool at start, so the
    # largest rank and the layers adapters may touch are fixed here ("all", or q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj).
    enable_lora: bool = False
    max_lora_rank: int = Field(default=64, ge=1, le=1024)
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all"])
    max_loras_per_batch: int = Field(default=8, ge=1)
    # Mixture-of-experts: expert-parallel load balancing and the expert-distribution recorder behind the
    # start/stop/dump_expert_distribution_record routes.
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = Field(default=1000, ge=1)
    ep_num_redundant_experts: int = Field(default=0, ge=0)
    init_expert_location: str = "trivial"
    expert_distribution_recorder_mode: Literal["stat", "stat_approx", "per_pass", "per_token"] | None = None
    expert_distribution_recorder_buffer_size: int | None = Field(default=None, ge=-1)
    # Sessions: the longest conversation one holds (SGLang counts characters) and how long an idle one lives.
    session_capacity_chars: int = Field(default=65536, ge=1)
    session_idle_s: float = Field(default=600.0, gt=0)
    # SGLang without its tokenizer (its `skip_tokenizer_init`): the scheduler's outputs come straight to this process
    # instead of crossing SGLang's detokenizer process first, and the worker makes the text itself
    # (detokenizer.py, stop strings included; a matched stop string aborts SGLang's request). What needs SGLang's
    # tokenizer is refused with an `unsupported` error: guided decoding, min_tokens, images, and stop strings in a
    # session's turn. Off by default: on the H100 it saved SGLang's detokenizer process (a quarter of a core at ~9.5k
    # tokens/s) with the token rate unchanged, but its first-token gain stayed within the noise (docs/performance.md,
    # twentieth stop).
    skip_tokenizer_init: bool = False
    # Any other ServerArgs field, passed through unchanged (JSON in CONVEYOR_SGLANG_EXTRA_SERVER_ARGS).
    extra_server_args: dict[str, Any] = Field(default_factory=dict)

    @field_validator("scheduler_cpus")
    @classmethod
    def _scheduler_cpus_known(cls, value: str) -> str:
        if value not in ("auto", "off"):
            try:
                parse_cpu_list(value)
            except ValueError:
                raise ValueError(f"scheduler_cpus is 'auto', 'off' or a CPU list like '14,15' or '12-15', "
                                 f"not {value!r}") from None
        return value


def image_item(request: GenerateRequest) -> dict[str, Any]:
    """The request's image rows as SGLang's one precomputed item (Dynamo's E/PD shape): SGLang places the rows on
    the prompt's image tokens in order, splits them per image by `image_grid_thw`, and keys each image's cache
    blocks by a hash of its rows."""
    import torch

    if not request.image_grids:
        raise UnsupportedOption("image rows without their patch grids: this SGLang model takes Qwen2-VL-style images")
    return {
        "format": "processor_output",
        "modality": "IMAGE",
        # SGLang casts the rows to the model's dtype where it places them.
        "precomputed_embeddings": request.image_rows,
        "image_grid_thw": torch.tensor(request.image_grids, dtype=torch.long),
    }


@dataclass(frozen=True, slots=True)
class KvEventsEndpoint:
    """Where SGLang publishes its KV events, and where the relay connects to hear them."""

    publish: str
    connect: str


def kv_events_endpoint(config: SGLangEngineConfig, private_dir: Path) -> KvEventsEndpoint:
    """SGLang's publisher binds only a wildcard TCP address or an ipc one (and connects to any other, which no relay
    would hear: found on the H100). A Unix socket in `private_dir` (the caller's, mode 0700) keeps the events, and
    the token ids of every prompt in them, off the network."""
    port = config.kv_events_port
    if not port and _data_parallel_size(config) > 1:
        port = _free_port()  # SGLang gives each data-parallel rank the port plus its rank, and refuses ipc there
    if port:
        return KvEventsEndpoint(publish=f"tcp://*:{port}", connect=f"tcp://127.0.0.1:{port}")
    socket_path = f"ipc://{private_dir / 'kv-events'}"
    return KvEventsEndpoint(publish=socket_path, connect=socket_path)


# A Unix socket's path is at most 107 bytes on Linux (103 on macOS); the folder leaves room for the socket's name.
_SOCKET_DIR_MAX_BYTES = 96


def private_socket_dir() -> Path:
    """A new folder only this user can open (mode 0700), for sockets: in the temp folder, or in /tmp when the temp
    folder's path is too long for a socket's."""
    folder = Path(tempfile.mkdtemp(prefix="conveyor-sglang-"))
    if len(str(folder).encode()) <= _SOCKET_DIR_MAX_BYTES:
        return folder
    folder.rmdir()
    return Path(tempfile.mkdtemp(prefix="conveyor-sglang-", dir="/tmp"))


def _data_parallel_size(config: SGLangEngineConfig) -> int:
    return int(config.extra_server_args.get("dp_size") or 1)


def server_args(config: SGLangEngineConfig, kv_events_publish: str | None, bootstrap_port: int) -> dict[str, Any]:
    """Keyword arguments for `sglang.Engine(...)`; `kv_events_publish` is `KvEventsEndpoint.publish`, None where the
    events are off."""
    args: dict[str, Any] = {
        "model_path": config.model_path,
        "load_format": config.load_format,
        "tp_size": config.tp_size,
        # Deltas, not cumulative output: what the Engine protocol streams.
        "incremental_streaming_output": True,
        "stream_interval": config.stream_interval,
        "enable_metrics": config.enable_metrics,
        "enable_memory_saver": config.enable_memory_saver,
        "log_level": "warning",
    }
    if config.skip_tokenizer_init:
        args["skip_tokenizer_init"] = True
    if config.kv_events and kv_events_publish is not None:
        publisher = PUBLISHER_NAME if config.kv_events_publisher == "inline" else "zmq"
        args["kv_events_config"] = json.dumps(
            {"publisher": publisher, "endpoint": kv_events_publish, "topic": "kv-events"})
    optional = {
        "page_size": config.page_size,
        "mem_fraction_static": config.mem_fraction_static,
        "context_length": config.context_length,
        "attention_backend": config.attention_backend,
        "mm_attention_backend": config.mm_attention_backend,
        "sampling_backend": config.sampling_backend,
    }
    args.update({key: value for key, value in optional.items() if value is not None})
    if config.enable_lora:
        args.update(enable_lora=True, max_lora_rank=config.max_lora_rank, lora_target_modules=config.lora_target_modules,
                    max_loras_per_batch=config.max_loras_per_batch)
    args.update(_expert_args(config))
    if config.role != DisaggregationRole.NONE:
        args["disaggregation_mode"] = config.role.value
        args["host"] = config.bootstrap_host
        args["disaggregation_transfer_backend"] = config.transfer_backend
        args["disaggregation_bootstrap_port"] = bootstrap_port
    args.update(config.extra_server_args)
    return args


def _expert_args(config: SGLangEngineConfig) -> dict[str, Any]:
    """EPLB and expert-distribution settings, only those changed from SGLang's defaults. EPLB rebalances from what
    the recorder saw, so it needs a recorder mode (SGLang picks `stat` when none is given)."""
    args: dict[str, Any] = {}
    if config.enable_eplb:
        args.update(enable_eplb=True, eplb_rebalance_num_iterations=config.eplb_rebalance_num_iterations)
    if config.ep_num_redundant_experts:
        args["ep_num_redundant_experts"] = config.ep_num_redundant_experts
    if config.init_expert_location != "trivial":
        args["init_expert_location"] = config.init_expert_location
    if config.expert_distribution_recorder_mode is not None:
        args["expert_distribution_recorder_mode"] = config.expert_distribution_recorder_mode
    if config.expert_distribution_recorder_buffer_size is not None:
        args["expert_distribution_recorder_buffer_size"] = config.expert_distribution_recorder_buffer_size
    return args


def cached_tokens_of(meta: dict[str, Any], prompt_tokens: int) -> int:
    """Prompt tokens SGLang served from its cache, within [0, prompt]: with `dllm_algorithm` it reports
    negative counts (-256 for a 64-token answer on the H100), which are not cache hits."""
    return min(max(int(meta.get("cached_tokens", 0)), 0), prompt_tokens)


def sampling_params(request: GenerateRequest, stop_strings: bool = True) -> dict[str, Any]:
    """SGLang's `sampling_params` for a request; unset options keep SGLang's defaults. Without `stop_strings` the
    request's stop strings are left out (an engine without its tokenizer cannot match them: the worker does)."""
    sampling, stop = request.sampling, request.stop
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "sampling_seed": sampling.seed,
        "n": sampling.n if sampling.n != 1 else None,
        "max_new_tokens": stop.max_tokens,
        "min_new_tokens": stop.min_tokens or None,
        "stop": (stop.stop or None) if stop_strings else None,
        "stop_token_ids": stop.stop_token_ids or None,
        "ignore_eos": stop.ignore_eos or None,
        "skip_special_tokens": request.output.skip_special_tokens,
    }
    guided = request.guided
    if guided is not None:
        if guided.json_schema is not None:
            params["json_schema"] = json.dumps(guided.json_schema)
        elif guided.grammar is not None:
            params["ebnf"] = guided.grammar
        else:
            params["regex"] = guided.regex if guided.regex is not None else choice_regex(guided.choice or [])
    return {key: value for key, value in params.items() if value is not None}


def needs_sglang_tokenizer(request: GenerateRequest) -> str | None:
    """What in this request an engine started without SGLang's tokenizer cannot do; None: nothing."""
    if request.guided is not None:
        return "guided decoding"  # SGLang compiles grammars against its tokenizer
    if request.stop.min_tokens:
        return "min_tokens"  # SGLang bans the tokenizer's EOS until then
    if request.image_rows is not None:
        return "images"  # SGLang's multimodal processor is part of its tokenizer side
    if request.session is not None and request.stop.stop:
        return "stop strings in a session"  # ending the turn here aborts it, and the session could not go on from it
    return None


class OwnText:
    """The text of one generation on an engine started without SGLang's tokenizer: the tokens SGLang streams, made
    into text here, with the request's stop strings matched across tokens. A match ends the generation."""

    def __init__(self, decoder: Decoder, request: GenerateRequest) -> None:
        self._detokenizer = IncrementalDetokenizer.of_request(decoder, request)

    def step(self, token_ids: list[int], reason: FinishReason | None,
             matched: str | int | None) -> tuple[str, FinishReason | None, str | int | None]:
        """The text of these tokens and the finish (reason, what matched): SGLang's own, or a stop string's here."""
        text = self._detokenizer.add(token_ids)
        stop = self._detokenizer.matched_stop
        if stop is not None:
            return text, FinishReason.STOP, stop
        if reason is not None:
            text += self._detokenizer.flush()  # what was held back as the start of a stop string that never came
        return text, reason, matched


def own_decoder(tokenizer_path: str) -> Decoder:
    """The model's tokenizer, to make text SGLang does not. Its Rust tokenizer is called directly where transformers
    adds nothing to decoding: 2.3 µs per token against 5.7 (scripts/bench_detokenize.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend  # type: ignore[no-any-return]
    return tokenizer  # type: ignore[no-any-return]


# SGLang's marker for a transfer that goes nowhere (`sglang.srt.disaggregation.utils`), which Dynamo
# also uses to warm prefill engines up.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


def bootstrap_arguments(request: GenerateRequest, role: DisaggregationRole) -> dict[str, Any]:
    """`bootstrap_*` arguments of `async_generate` for this request on an engine in this role.

    SGLang refuses a request without a bootstrap room in a disaggregated role (found on the H100:
    "Disaggregated request received without bootstrap room id"), so a health check there gets a fake
    transfer, as Dynamo's warm-up does; any other request must carry real bootstrap info.
    """
    if request.bootstrap is not None:
        return {"bootstrap_host": request.bootstrap.bootstrap_host, "bootstrap_port": request.bootstrap.bootstrap_port,
                "bootstrap_room": request.bootstrap.bootstrap_room}
    if role == DisaggregationRole.NONE:
        return {}
    if request.health_check:
        return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": random.getrandbits(63)}
    raise UnsupportedOption(f"this engine serves the {role.value} side of disaggregated serving: "
                            "requests need bootstrap info (route them through a prefill worker)")


def finish_of(meta_info: dict[str, Any]) -> tuple[FinishReason | None, str | int | None, str | None]:
    """(finish reason, matched stop, error) from an item's meta_info, normalized like Dynamo's."""
    reason = meta_info.get("finish_reason")
    if not reason:
        return None, None, None
    kind = reason.get("type", "") if isinstance(reason, dict) else str(reason)
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if kind.startswith("abort"):
        message = reason.get("message") if isinstance(reason, dict) else None
        # SGLang aborts both for cancels and for requests it refused (e.g. too long).
        if message and "abort" not in str(message).lower():
            return FinishReason.ERROR, None, str(message)
        return FinishReason.CANCELLED, None, None
    if kind == "length":
        return FinishReason.LENGTH, None, None
    if kind == "stop":
        return FinishReason.STOP, matched if isinstance(matched, str | int) else None, None
    if kind.startswith("error"):
        return FinishReason.ERROR, None, kind.partition(":")[2].strip() or "backend error"
    return FinishReason.STOP, None, None


def logprobs_of(meta_info: dict[str, Any], num_new: int,
                text_of: Callable[[int], str] | None = None) -> list[TokenLogprob] | None:
    """The last `num_new` entries of `output_token_logprobs` ([logprob, token_id, text?] each); `text_of` gives a
    token's text where SGLang's entry has none (`Engine.async_generate` cannot ask for it)."""
    entries = meta_info.get("output_token_logprobs")
    if not entries or num_new == 0:
        return None
    tops = meta_info.get("output_top_logprobs") or []
    result = []
    for index, entry in enumerate(entries[-num_new:]):
        top_entries = tops[-num_new:][index] if len(tops) >= num_new else []
        result.append(TokenLogprob(
            token_id=int(entry[1]), logprob=float(entry[0]), token=_text_of(entry, text_of),
            top=[TopLogprob(token_id=int(t[1]), logprob=float(t[0]), token=_text_of(t, text_of))
                 for t in (top_entries or [])],
        ))
    return result


def _text_of(entry: Any, text_of: Callable[[int], str] | None) -> str | None:
    """The token text SGLang adds as the entry's third item (`return_text_in_logprobs`), else `text_of`'s."""
    if len(entry) > 2 and isinstance(entry[2], str):
        return str(entry[2])
    return text_of(int(entry[1])) if text_of is not None else None


_FIELD_NAMES = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
                "BlockRemoved": ["block_hashes", "medium"], "AllBlocksCleared": []}


def _kind_and_fields(raw: Any) -> tuple[Any, dict[str, Any]]:
    """A msgspec tagged-array event (or a map with a `type` key) as (kind, fields)."""
    if isinstance(raw, dict):
        return raw.get("type"), raw
    if isinstance(raw, list) and raw:
        return raw[0], dict(zip(_FIELD_NAMES.get(raw[0], []), raw[1:]))
    return None, {}


def _chains_on(previous: dict[str, Any], fields: dict[str, Any]) -> bool:
    """Whether a stored block continues the previous stored run (same chain, size, adapter and medium)."""
    return (fields.get("parent_block_hash") == previous["block_hashes"][-1]
            and all(fields.get(key) == previous.get(key) for key in ("block_size", "lora_id", "medium")))


def _merged(raw_events: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """Events with each run of chained BlockStored merged into one. SGLang records one event per page (per token
    at page size 1): merging before building models keeps the relay's cost per prompt, not per page."""
    merged: list[tuple[Any, dict[str, Any]]] = []
    for raw in raw_events:
        kind, fields = _kind_and_fields(raw)
        if kind == "BlockStored" and merged and merged[-1][0] == "BlockStored" and _chains_on(merged[-1][1], fields):
            previous = merged[-1][1]
            previous["block_hashes"].extend(fields["block_hashes"])
            previous["token_ids"].extend(fields["token_ids"])
            continue
        if kind == "BlockStored":  # lists of our own, extended in place by the blocks that chain on
            fields = {**fields, "block_hashes": list(fields["block_hashes"]), "token_ids": list(fields["token_ids"])}
        merged.append((kind, fields))
    return merged


def _event_of(kind: Any, fields: dict[str, Any]) -> KvEvent | None:
    """One SGLang event's kind and fields as ours; unknown kinds: None."""
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=[_u64(h) for h in fields["block_hashes"]],
            parent_block_hash=_u64(fields["parent_block_hash"]) if fields.get("parent_block_hash") is not None else None,
            token_ids=list(fields["token_ids"]), block_size=int(fields["block_size"]),
            lora_id=fields.get("lora_id"), medium=fields.get("medium"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=[_u64(h) for h in fields["block_hashes"]], medium=fields.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _u64(value: int) -> int:
    # SGLang hashes arrive as i64 or u64; reinterpret bitwise as u64 (the reference notes, J.57).
    return value & 0xFFFF_FFFF_FFFF_FFFF


def decode_event_frames(frames: list[bytes]) -> tuple[int, KvEventBatchOut] | None:
    """`[topic, seq (8 bytes BE), payload]` → (seq, batch); malformed frames give None."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    seq = int.from_bytes(frames[1], "big")
    batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, raw_events, rank = batch.get("ts", time.time()), batch.get("events", []), batch.get("attn_dp_rank")
    else:
        ts, raw_events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    events = [event for event in (_event_of(kind, fields) for kind, fields in _merged(raw_events)) if event is not None]
    return seq, KvEventBatchOut(events=events, ts=float(ts), data_parallel_rank=int(rank or 0))


class BlockKeys:
    """SGLang's block hashes as the chained keys every engine here publishes (schemas/kv_hashing.py), which is what a
    router computes from a prompt's tokens. SGLang's own hashes are ids private to it: without this a router never
    finds an SGLang worker's blocks. They are kept, mapped to ours, only to translate SGLang's removals."""

    def __init__(self) -> None:
        self._ours: dict[int, int] = {}
        self._held: set[int] = set()  # our keys of the blocks the engine holds

    def __len__(self) -> int:
        return len(self._ours)

    def cached_prefix_tokens(self, token_ids: list[int], block_size: int) -> int:
        """Tokens of the prompt's longest prefix whose blocks the engine holds (as far as its events said)."""
        held = takewhile(self._held.__contains__, iter_chain_hashes(token_ids, block_size))
        return sum(1 for _ in held) * block_size

    def translate(self, event: KvEvent) -> KvEvent | None:
        """The event in our keys; None when nothing of it can be translated."""
        if isinstance(event, BlockStored):
            return self._stored(event)
        if isinstance(event, BlockRemoved):
            keys = [key for engine_hash in event.block_hashes if (key := self._ours.pop(engine_hash, None)) is not None]
            self._held.difference_update(keys)
            return BlockRemoved(block_hashes=keys, medium=event.medium) if keys else None
        self._ours.clear()  # AllBlocksCleared
        self._held.clear()
        return event

    def _stored(self, event: BlockStored) -> BlockStored | None:
        if event.lora_id is not None:
            # SGLang names the adapter by a number of its own; our keys salt an adapter's blocks with its name
            # (`lora_root`), unknown here. Left out, so that no prompt is credited with blocks it cannot use.
            return None
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._ours.get(event.parent_block_hash)
            if parent is None:
                # Chained on a block stored before the relay listened (or never published): its key is unknown,
                # so no key of this chain can be computed. Its prompts are simply not found cached.
                return None
        first_parent, size, keys = parent, event.block_size, []
        for index, engine_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            if len(tokens) < size:
                break
            parent = block_hash(parent, tokens)
            self._ours[engine_hash] = parent
            self._held.add(parent)
            keys.append(parent)
        if not keys:
            return None
        return event.model_copy(update={"block_hashes": keys, "parent_block_hash": first_parent,
                                        "token_ids": event.token_ids[: len(keys) * size]})


class KvEventRelay:
    """Subscribes to SGLang's ZMQ KV-event publisher, translates its block hashes into ours (`BlockKeys`) and fans
    batches out to our listeners."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.batches = KvEventFanout()
        self.keys = BlockKeys()
        self._task: asyncio.Task[None] | None = None
        self.last_seq: int | None = None
        self.gaps = 0
        self.batches_heard = 0

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        self._socket = context.socket(zmq.SUB)
        self._socket.connect(self.endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._socket.close(linger=0)

    async def _run(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                decoded = decode_event_frames(frames)
            except Exception as error:  # one bad frame must not stop the relay
                log.warning("sglang.kv_event_undecodable", error=repr(error))
                continue
            if decoded is None:
                log.warning("sglang.kv_event_malformed", frames=len(frames))
                continue
            seq, batch = decoded
            self.batches_heard += 1
            if self.last_seq is not None and seq > self.last_seq + 1:
                self.gaps += 1
                log.warning("sglang.kv_event_gap", missed=seq - self.last_seq - 1)
            self.last_seq = seq
            ours = self.translated(batch)
            if ours.events:
                self.batches.publish(ours)

    def translated(self, batch: KvEventBatchOut) -> KvEventBatchOut:
        events = [ours for event in batch.events if (ours := self.keys.translate(event)) is not None]
        return KvEventBatchOut(events=events, ts=batch.ts, data_parallel_rank=batch.data_parallel_rank)


class SilentEventsWatch:
    """Says once when requests long enough to fill pages of SGLang's cache have finished and the relay has heard no
    KV event: SGLang's publisher and the relay missed each other (on the H100 a loopback endpoint once made both ends
    connect, and nothing said so). A KV router then weighs this worker by its load alone."""

    def __init__(self, relay: KvEventRelay, page_tokens: int, after_requests: int = 8) -> None:
        self._relay = relay
        self._page_tokens = page_tokens
        self._after_requests = after_requests
        self._requests = 0
        self.reported = False

    def finished(self, num_tokens: int) -> None:
        """A request SGLang finished, prompt and output `num_tokens` long."""
        # Two pages: the cache stores whole pages, so a shorter one may leave no event.
        if self.reported or num_tokens < 2 * self._page_tokens:
            return
        self._requests += 1
        if self._requests >= self._after_requests and self._relay.batches_heard == 0:
            self.reported = True
            log.warning("sglang.kv_events_silent", endpoint=self._relay.endpoint, requests=self._requests,
                        detail="no KV event from SGLang after these requests; a KV router sees this worker's load "
                               "only (CONVEYOR_SGLANG_KV_EVENTS_PORT sets where SGLang publishes)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SGLangEngine:
    def __init__(self, config: SGLangEngineConfig) -> None:
        self.config = config
        self._engine: Any = None
        self._relay: KvEventRelay | None = None
        self._events_watch: SilentEventsWatch | None = None
        # The worker's own tokenizer, when SGLang runs without one (skip_tokenizer_init).
        self._decoder: Decoder | None = None
        self._bootstrap: BootstrapEndpoint | None = None
        # Until start() reads the model, the context length is what was configured (0: unknown).
        self._info = EngineInfo(name="sglang", model=config.model_path, context_length=config.context_length or 0,
                                role=config.role)
        self._load = EngineLoad(0, 0, 1, 0, 0)
        self._load_task: asyncio.Task[None] | None = None
        self._cpu_claims: list[CpuClaim] = []
        # Sockets only this user opens (the KV events'), removed at shutdown.
        self._private_dir: Path | None = None
        self._loras: dict[str, str] = {}
        self._lora_lock = asyncio.Lock()
        # Open sessions -> the request id of their last finished turn (the node the next turn continues from).
        self._sessions: dict[str, str | None] = {}
        paces = config.prefill_budget_tokens > 0 and config.role == DisaggregationRole.NONE
        self._prefill_budget = PrefillBudget(config.prefill_budget_tokens) if paces else None

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        import sglang

        kv_events: KvEventsEndpoint | None = None
        if self.config.kv_events:
            self._private_dir = private_socket_dir()
            kv_events = kv_events_endpoint(self.config, self._private_dir)
        bootstrap_port = self.config.bootstrap_port or _free_port()
        args = server_args(self.config, kv_events.publish if kv_events else None, bootstrap_port)
        log.info("sglang.starting", model=self.config.model_path, role=self.config.role.value)
        inline = kv_events is not None and self.config.kv_events_publisher == "inline"
        self._engine = (inline_publisher_engine() if inline else sglang.Engine)(**args)
        if self.config.skip_tokenizer_init:
            tokenizer_path = self.config.extra_server_args.get("tokenizer_path") or self.config.model_path
            self._decoder = await asyncio.to_thread(own_decoder, str(tokenizer_path))
        manager = self._engine.tokenizer_manager
        self._info = EngineInfo(
            name="sglang",
            model=self.config.model_path,
            context_length=int(manager.model_config.context_len),
            role=self.config.role,
            eos_token_ids=tuple(sorted(manager.model_config.hf_eos_token_id or ())),
            max_running_requests=await self._max_running_requests(),
        )
        if self.config.role == DisaggregationRole.PREFILL:
            advertised = advertised_host(self.config.bootstrap_host)
            self._bootstrap = BootstrapEndpoint(host=advertised, port=bootstrap_port)
        if kv_events is not None:
            self._relay = KvEventRelay(kv_events.connect)
            await self._relay.start()
            if not self.config.extra_server_args.get("disable_radix_cache"):  # no cache, no events
                self._events_watch = SilentEventsWatch(self._relay, self.config.page_size or 1)
        # In a thread: it asks nvidia-smi which GPU each scheduler is on (a second or so, not on the event loop).
        self._cpu_claims = await asyncio.to_thread(pin_schedulers, self.config.scheduler_cpus,
                                                   self.config.scheduler_cpus_lock_dir)
        self._load_task = asyncio.create_task(self._refresh_load())

    async def _max_running_requests(self) -> int | None:
        """What SGLang's schedulers run at once (it sizes this from the KV pool when not told), summed over data-
        parallel ranks: the worker then holds no more tasks than that (runtime.py)."""
        try:
            states = await self._engine.tokenizer_manager.get_internal_state()
            return sum(int(state["effective_max_running_requests_per_dp"]) for state in states) or None
        except Exception as error:  # an SGLang without the field: the worker's --max-concurrency stands
            log.warning("sglang.max_running_requests_unknown", error=repr(error))
            return None

    async def shutdown(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        if self._relay is not None:
            await self._relay.stop()
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
            self._engine = None
        for claim in self._cpu_claims:
            claim.release()
        self._cpu_claims = []
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        own_text = None
        if self._decoder is not None:
            if (needed := needs_sglang_tokenizer(request)) is not None:
                raise UnsupportedOption(f"{needed}: needs SGLang's tokenizer, and this engine runs without it "
                                        "(CONVEYOR_SGLANG_SKIP_TOKENIZER_INIT)")
            own_text = OwnText(self._decoder, request)
        kwargs: dict[str, Any] = {
            "input_ids": request.token_ids,
            "sampling_params": sampling_params(request, stop_strings=own_text is None),
            "stream": True,
            "rid": request.request_id,
            "return_logprob": request.output.logprobs,
        }
        if request.output.logprobs and request.output.top_logprobs:
            kwargs["top_logprobs_num"] = request.output.top_logprobs
        kwargs.update(bootstrap_arguments(request, self.config.role))
        if request.priority is not None:
            kwargs["priority"] = request.priority
        if request.lora_name is not None:
            if request.lora_name not in self._loras:
                raise UnsupportedOption(f"LoRA adapter {request.lora_name!r} is not loaded on this engine")
            kwargs["lora_path"] = request.lora_name  # SGLang takes the adapter's name here
        if request.session is not None:
            kwargs["session_params"] = {"id": request.session.id, "rid": await self._session_turn(request)}
        if request.image_rows is not None:
            kwargs["image_data"] = [image_item(request)]
        try:
            admission = await self._admit(request)
        except Withdrawn:  # cancelled while it waited for its share: SGLang never saw it
            if request.session is not None:
                await self._end_turn(request, completed=False)  # a closing turn still closes its session
            yield GenerateOutput([], finish_reason=FinishReason.CANCELLED, prompt_tokens=len(request.token_ids))
            return
        finished = False  # the final output went out
        engine_done = False  # SGLang ended the request itself (not a stop string matched here)
        num_output_tokens = 0
        try:
            stream = await self._engine.async_generate(**kwargs)
            async for item in stream:
                meta = item.get("meta_info", {})
                reason, matched, error = finish_of(meta)
                token_ids = list(item.get("output_ids") or [])
                if not token_ids and reason is None:
                    continue  # an idle tick
                engine_done = reason is not None
                text = item.get("text") or ""
                if own_text is not None:
                    text, reason, matched = own_text.step(token_ids, reason, matched)
                num_output_tokens += len(token_ids)
                if admission is not None and (reason is not None or num_output_tokens >= RELEASE_AFTER_TOKENS):
                    admission.release()  # a decode step ran after its prefill (or it ended): the next share may go in
                finished = reason is not None
                if finished and request.session is not None:
                    # Before the final output goes out: its reader stops reading there, and the next turn may come.
                    await self._end_turn(request, completed=reason in (FinishReason.STOP, FinishReason.LENGTH))
                prompt_tokens = int(meta.get("prompt_tokens", len(request.token_ids)))
                yield GenerateOutput(
                    token_ids=token_ids,
                    text=text,
                    finish_reason=reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=int(meta.get("completion_tokens", 0)),
                    cached_tokens=cached_tokens_of(meta, prompt_tokens),
                    logprobs=logprobs_of(meta, len(token_ids), self._token_text),
                    matched_stop=matched,
                    error=error,
                )
                if finished:
                    if engine_done and self._events_watch is not None:
                        self._events_watch.finished(len(request.token_ids) + num_output_tokens)
                    return
        finally:
            if admission is not None:
                admission.release()
            if not engine_done:
                await self.abort(request.request_id)
            if not finished and request.session is not None:
                await self._end_turn(request, completed=False)

    async def _admit(self, request: GenerateRequest) -> Admission | None:
        """This request's share of the prefill budget (None: not paced). What SGLang's prefix cache holds, as its
        KV events told, is not counted: it costs no prefill."""
        if self._prefill_budget is None:
            return None
        num_tokens = len(request.token_ids)
        if self._relay is not None and self.config.page_size and request.lora_name is None:
            num_tokens -= self._relay.keys.cached_prefix_tokens(request.token_ids, self.config.page_size)
        return await self._prefill_budget.admit(request.request_id, num_tokens)

    async def abort(self, request_id: str) -> None:
        if self._prefill_budget is not None and self._prefill_budget.withdraw(request_id):
            return
        if self._engine is not None:
            self._engine.tokenizer_manager.abort_request(rid=request_id)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self._decoder or self._engine.tokenizer_manager.tokenizer
        return str(tokenizer.decode([token_id], skip_special_tokens=True))

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        """Vectors of token-id lists (an `is_embedding` engine). `Engine.async_encode` takes only text, so the
        request goes to SGLang's tokenizer manager as token ids."""
        from sglang.srt.managers.io_struct import EmbeddingReqInput

        result = await self._engine.tokenizer_manager.generate_request(EmbeddingReqInput(input_ids=inputs), None).__anext__()
        items = result if isinstance(result, list) else [result]
        return [list(item["embedding"]) for item in items]

    def load(self) -> EngineLoad:
        paced = self._prefill_budget
        if paced is None or not paced.num_waiting:
            return self._load
        # Requests held for a prefill share wait as SGLang's own queue does: the router and /metrics count them.
        return replace(self._load, waiting_requests=self._load.waiting_requests + paced.num_waiting,
                       waiting_prompt_tokens=self._load.waiting_prompt_tokens + paced.waiting_tokens)

    async def _refresh_load(self) -> None:
        while True:
            try:
                snapshots = await self._engine.tokenizer_manager.get_loads()
                if snapshots:
                    page = self.config.page_size or 1
                    used = sum(s.num_used_tokens for s in snapshots)
                    total = sum(s.max_total_num_tokens for s in snapshots)
                    self._load = EngineLoad(
                        running_requests=sum(s.num_running_reqs for s in snapshots),
                        waiting_requests=sum(s.num_waiting_reqs for s in snapshots),
                        kv_block_size=page,
                        kv_total_blocks=total // page,
                        kv_used_blocks=-(-used // page),
                        cache_hit_rate=max(s.cache_hit_rate for s in snapshots),
                        waiting_prompt_tokens=sum(getattr(s, "num_waiting_uncached_tokens", 0) for s in snapshots),
                    )
            except Exception as error:  # metrics only; never take the worker down
                log.warning("sglang.load_failed", error=repr(error))
            await asyncio.sleep(1.0)

    def kv_events(self) -> AsyncIterator[KvEventBatchOut]:
        if self._relay is None:
            raise RuntimeError("this engine records no KV events (kv_events=False): run its worker with --no-kv-events")
        return self._relay.batches.listen()

    @property
    def bootstrap_endpoint(self) -> BootstrapEndpoint | None:
        return self._bootstrap

    async def release_memory(self, tags: list[MemoryTag]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        await self._engine.tokenizer_manager.release_memory_occupation(
            ReleaseMemoryOccupationReqInput(tags=[tag.value for tag in tags]), None
        )

    async def resume_memory(self, tags: list[MemoryTag]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._engine.tokenizer_manager.resume_memory_occupation(
            ResumeMemoryOccupationReqInput(tags=[tag.value for tag in tags]), None
        )

    async def start_profile(self, output_dir: Path) -> None:
        from sglang.srt.managers.io_struct import ProfileReq

        await self._engine.tokenizer_manager.start_profile(ProfileReq(output_dir=str(output_dir)))

    async def stop_profile(self) -> None:
        await self._engine.tokenizer_manager.stop_profile()

    async def update_weights_from_disk(self, model_path: Path) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        result = await self._engine.tokenizer_manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path=str(model_path)), None
        )
        success = result[0] if isinstance(result, tuple) else getattr(result, "success", True)
        if not success:
            raise RuntimeError(f"SGLang refused the weights at {model_path}: {result}")

    async def flush_cache(self) -> None:
        result = await self._engine.tokenizer_manager.flush_cache()
        if not getattr(result, "success", True):
            raise RuntimeError("SGLang could not flush its cache (requests are running)")

    async def load_lora(self, name: str, path: str) -> None:
        if not self.config.enable_lora:
            raise UnsupportedOption("LoRA is off on this SGLang engine: start it with CONVEYOR_SGLANG_ENABLE_LORA=true")
        from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput

        async with self._lora_lock:
            if self._loras.get(name) == path:
                return
            if name in self._loras:
                raise ValueError(f"adapter {name!r} is loaded from {self._loras[name]}; unload it before loading {path}")
            result = await self._engine.tokenizer_manager.load_lora_adapter(
                LoadLoRAAdapterReqInput(lora_name=name, lora_path=path), None)
            if not result.success:
                raise ValueError(f"SGLang could not load {path}: {result.error_message}")
            self._loras[name] = path

    async def unload_lora(self, name: str) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        async with self._lora_lock:
            if name not in self._loras:
                return
            result = await self._engine.tokenizer_manager.unload_lora_adapter(
                UnloadLoRAAdapterReqInput(lora_name=name), None)
            if not result.success:
                raise RuntimeError(f"SGLang could not unload {name!r}: {result.error_message}")
            del self._loras[name]

    def loras(self) -> dict[str, str]:
        return dict(self._loras)

    async def _session_turn(self, request: GenerateRequest) -> str | None:
        """The request id this session's turn continues from (None: the session's start), opening it if asked."""
        from sglang.srt.managers.io_struct import OpenSessionReqInput

        session = request.session
        assert session is not None
        if session.id not in self._sessions:
            if not session.opens:
                raise UnsupportedOption(f"session {session.id!r} is not open on this engine (its worker restarted): "
                                        "start a new session")
            # SGLang's sessions keep a tree of turns: each turn names the one it follows (`rid`).
            await self._engine.tokenizer_manager.open_session(
                OpenSessionReqInput(capacity_of_str_len=self.config.session_capacity_chars, session_id=session.id,
                                    timeout=self.config.session_idle_s), None)
            self._sessions[session.id] = None
        return self._sessions[session.id]

    async def _end_turn(self, request: GenerateRequest, completed: bool) -> None:
        from sglang.srt.managers.io_struct import CloseSessionReqInput

        session = request.session
        assert session is not None
        if completed:
            self._sessions[session.id] = request.request_id
        if session.closes:
            self._sessions.pop(session.id, None)
            await self._engine.tokenizer_manager.close_session(CloseSessionReqInput(session_id=session.id), None)

    async def record_experts(self, action: ExpertRecording) -> None:
        if self.config.expert_distribution_recorder_mode is None and not self.config.enable_eplb:
            # Found on the H100: without a recorder mode SGLang's scheduler raises on this call and the engine dies.
            raise UnsupportedOption("the expert-distribution recorder is off: start the engine with "
                                    "CONVEYOR_SGLANG_EXPERT_DISTRIBUTION_RECORDER_MODE=stat (or per_pass, per_token)")
        manager = self._engine.tokenizer_manager
        operation = {ExpertRecording.START: manager.start_expert_distribution_record,
                     ExpertRecording.STOP: manager.stop_expert_distribution_record,
                     ExpertRecording.DUMP: manager.dump_expert_distribution_record}[action]
        await operation()


class SGLangEmbedder:
    """The embed stage's model on SGLang with `is_embedding` (a BERT-, Qwen- or Llama-embedding-shaped model):
    SGLang pools and normalizes as the model's config says; the stage truncates `dimensions` itself."""

    def __init__(self, model_path: str, load_format: str = "auto") -> None:
        base = SGLangEngineConfig(model_path=model_path, load_format=load_format)
        self._engine = SGLangEngine(base.model_copy(update={
            "extra_server_args": {**base.extra_server_args, "is_embedding": True}}))
        self.dimensions = int(json.loads((Path(model_path) / "config.json").read_text())["hidden_size"])
        self.max_tokens = 0  # read from the engine once it has started

    async def start(self) -> None:
        await self._engine.start()
        self.max_tokens = self._engine.info.context_length

    async def stop(self) -> None:
        await self._engine.shutdown()

    async def embed(self, inputs: list[list[int]]) -> Any:
        import torch

        return torch.tensor(await self._engine.encode(inputs), dtype=torch.float32)
