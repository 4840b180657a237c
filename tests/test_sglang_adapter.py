"""The SGLang adapter's mappings, testable without a GPU or sglang installed: sampling parameters,
finish reasons, engine arguments, and SGLang's ZMQ KV-event frames relayed as ours."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
from pydantic import ValidationError

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from schemas.kv_hashing import chain_hashes
from schemas.replies import FinishReason
from schemas.sampling import GuidedDecoding, SamplingOptions, StopConditions
from schemas.tasks import SessionRef
from workers.engines.protocol import DisaggregationRole, Engine, ExpertRecording, GenerateRequest, UnsupportedOption
from workers.engines.sglang_engine import (
    KvEventRelay,
    SGLangEngine,
    SGLangEngineConfig,
    cached_tokens_of,
    decode_event_frames,
    finish_of,
    kv_events_endpoint,
    OwnText,
    logprobs_of,
    needs_sglang_tokenizer,
    own_decoder,
    sampling_params,
    server_args,
)
from workers.engines.torch_engine.loader import bundled_smollm2


def test_adapter_implements_the_engine_protocol_without_importing_sglang() -> None:
    import sys

    assert isinstance(SGLangEngine(SGLangEngineConfig(model_path="/models/x")), Engine)
    assert "sglang" not in sys.modules


def test_every_sampling_option_maps_to_sglangs_name() -> None:
    request = GenerateRequest(
        "r", [1, 2],
        SamplingOptions(temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, frequency_penalty=0.2, presence_penalty=0.3,
                        repetition_penalty=1.1, seed=42, n=2),
        StopConditions(max_tokens=64, min_tokens=3, stop=["\n"], stop_token_ids=[7], ignore_eos=True),
        guided=GuidedDecoding(json_schema={"type": "object"}),
    )
    assert sampling_params(request) == {
        "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "frequency_penalty": 0.2,
        "presence_penalty": 0.3, "repetition_penalty": 1.1, "sampling_seed": 42, "n": 2, "max_new_tokens": 64,
        "min_new_tokens": 3, "stop": ["\n"], "stop_token_ids": [7], "ignore_eos": True, "skip_special_tokens": True,
        "json_schema": json.dumps({"type": "object"}),
    }
    assert sampling_params(GenerateRequest("d", [1])) == {"skip_special_tokens": True}


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        (None, (None, None, None)),
        ({"type": "stop", "matched": 2}, (FinishReason.STOP, 2, None)),
        ({"type": "stop", "matched": "END"}, (FinishReason.STOP, "END", None)),
        ({"type": "length", "length": 16}, (FinishReason.LENGTH, None, None)),
        ({"type": "abort", "message": "Abort in waiting queue"}, (FinishReason.CANCELLED, None, None)),
        ({"type": "abort", "message": "The input (9000 tokens) is longer than the model's context length"},
         (FinishReason.ERROR, None, "The input (9000 tokens) is longer than the model's context length")),
    ],
)
def test_finish_reasons_are_normalized(finish: dict | None, expected: tuple) -> None:  # type: ignore[type-arg]
    assert finish_of({"finish_reason": finish}) == expected


def test_logprobs_of_the_newest_tokens() -> None:
    meta = {"output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 7, None]],
            "output_top_logprobs": [[[-0.1, 5, None]], [[-0.2, 6, None]], [[-0.3, 7, None], [-1.0, 8, None]]]}
    logprobs = logprobs_of(meta, 1)
    assert logprobs is not None and logprobs[0].token_id == 7 and [t.token_id for t in logprobs[0].top] == [7, 8]
    # Engine.async_generate cannot ask SGLang for the tokens' text: the adapter's tokenizer supplies it.
    named = logprobs_of(meta, 1, text_of=lambda token_id: f"t{token_id}")
    assert named is not None and named[0].token == "t7" and [t.token for t in named[0].top] == ["t7", "t8"]


def test_engine_arguments_turn_on_deltas_kv_events_and_disaggregation() -> None:
    args = server_args(SGLangEngineConfig(model_path="/m", role=DisaggregationRole.PREFILL, page_size=16),
                       "ipc:///run/x/kv-events", 8998)
    assert args["incremental_streaming_output"] is True
    assert json.loads(args["kv_events_config"]) == {"publisher": "conveyor-inline", "endpoint": "ipc:///run/x/kv-events",
                                                    "topic": "kv-events"}
    assert args["disaggregation_mode"] == "prefill" and args["disaggregation_bootstrap_port"] == 8998
    assert args["disaggregation_transfer_backend"] == "nixl" and args["attention_backend"] == "triton"
    # The bootstrap server binds where the adapter advertises it (found on the H100).
    assert args["host"] == "127.0.0.1"
    assert "disaggregation_mode" not in server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)


def test_bootstrap_arguments_by_role() -> None:
    from schemas.tasks import BootstrapInfo
    from workers.engines.protocol import UnsupportedOption
    from workers.engines.sglang_engine import FAKE_BOOTSTRAP_HOST, bootstrap_arguments

    room = BootstrapInfo(bootstrap_host="10.0.0.5", bootstrap_port=8998, bootstrap_room=42)
    assert bootstrap_arguments(GenerateRequest("r", [1], bootstrap=room), DisaggregationRole.DECODE) == {
        "bootstrap_host": "10.0.0.5", "bootstrap_port": 8998, "bootstrap_room": 42}
    assert bootstrap_arguments(GenerateRequest("r", [1]), DisaggregationRole.NONE) == {}
    canary = bootstrap_arguments(GenerateRequest("c", [1], health_check=True), DisaggregationRole.PREFILL)
    assert canary["bootstrap_host"] == FAKE_BOOTSTRAP_HOST and 0 <= canary["bootstrap_room"] < 2**63
    with pytest.raises(UnsupportedOption, match="bootstrap"):
        bootstrap_arguments(GenerateRequest("r", [1]), DisaggregationRole.DECODE)


def sglang_frame(seq: int, events: list[list[object]], rank: int | None = 0) -> list[bytes]:
    """What SGLang's ZmqEventPublisher sends: msgspec array_like batch of tagged-array events."""
    payload = msgpack.packb([1700000000.5, events, rank])
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def test_sglang_event_frames_decode_into_our_events() -> None:
    frames = sglang_frame(3, [
        ["BlockStored", [-1, 17], None, list(range(32)), 16, None, "GPU"],
        ["BlockRemoved", [17], None],
        ["AllBlocksCleared"],
    ], rank=1)
    decoded = decode_event_frames(frames)
    assert decoded is not None
    seq, batch = decoded
    assert seq == 3 and batch.data_parallel_rank == 1 and batch.ts == 1700000000.5
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**64 - 1, 17] and stored.medium == "GPU"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [17]
    assert isinstance(cleared, AllBlocksCleared)
    assert decode_event_frames(frames[:2]) is None


def test_sglangs_per_page_events_of_one_chain_merge_into_one() -> None:
    # SGLang records one BlockStored per page; a run chained by parent hash becomes one event with every block.
    pages = [["BlockStored", [100 + i], (100 + i - 1) if i else 7, [i] * 4, 4, None, None] for i in range(5)]
    other_chain = ["BlockStored", [900], 55, [9] * 4, 4, None, None]
    frames = sglang_frame(1, [*pages, other_chain, ["BlockRemoved", [100], None], pages[0]])
    decoded = decode_event_frames(frames)
    assert decoded is not None
    chain, other, removed, again = decoded[1].events
    assert isinstance(chain, BlockStored) and chain.block_hashes == [100, 101, 102, 103, 104]
    assert chain.parent_block_hash == 7 and chain.token_ids == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert isinstance(other, BlockStored) and other.block_hashes == [900] and other.parent_block_hash == 55
    assert isinstance(removed, BlockRemoved)
    # A removal between two stores ends the run: the order of stores and removals is kept.
    assert isinstance(again, BlockStored) and again.block_hashes == [100]


def test_sglang_pages_default_to_sixteen_tokens() -> None:
    # Page size 1 makes SGLang record an event per token (the relay took half the decode worker's loop on the H100).
    assert server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)["page_size"] == 16


def test_sglang_streams_every_eighth_step_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    # Outputs every 8 decode steps (the first token at once): SGLang's scheduler and detokenizer handle an eighth of
    # the outputs they would at its own default of 1 (docs/performance.md, forty-seventh stop).
    assert server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)["stream_interval"] == 8
    monkeypatch.setenv("CONVEYOR_SGLANG_STREAM_INTERVAL", "1")
    assert server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)["stream_interval"] == 1
    with pytest.raises(ValidationError, match="stream_interval"):
        SGLangEngineConfig(model_path="/m", stream_interval=0)


def test_sglang_own_metrics_are_off_unless_asked_for() -> None:
    # They cost the inter-token gap at one stream and nothing reads them (the worker's /metrics has its own series).
    assert server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)["enable_metrics"] is False
    with_metrics = SGLangEngineConfig(model_path="/m", enable_metrics=True)
    assert server_args(with_metrics, "ipc:///k", 2)["enable_metrics"] is True


def test_sglang_records_no_kv_events_when_they_are_off() -> None:
    # `--no-kv-events`: SGLang is not asked to record them at all (nothing would read them).
    assert "kv_events_config" not in server_args(SGLangEngineConfig(model_path="/m", kv_events=False), "ipc:///k", 2)
    assert "kv_events_config" in server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)


def test_kv_events_stay_on_a_private_socket_unless_a_port_is_asked_for(tmp_path: Path) -> None:
    private = kv_events_endpoint(SGLangEngineConfig(model_path="/m"), tmp_path)
    assert private.publish == private.connect == f"ipc://{tmp_path}/kv-events"
    # A port: published on every interface for subscribers of one's own; the relay hears it on loopback.
    shared = kv_events_endpoint(SGLangEngineConfig(model_path="/m", kv_events_port=5557), tmp_path)
    assert (shared.publish, shared.connect) == ("tcp://*:5557", "tcp://127.0.0.1:5557")
    # Data-parallel ranks each publish on the port plus their rank; SGLang refuses ipc for them.
    ranks = kv_events_endpoint(SGLangEngineConfig(model_path="/m", extra_server_args={"dp_size": 2}), tmp_path)
    assert ranks.publish.startswith("tcp://*:") and ranks.connect.startswith("tcp://127.0.0.1:")


def _free_tcp_endpoint(_: Path) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize("endpoint_in", [_free_tcp_endpoint, lambda folder: f"ipc://{folder}/kv-events"],
                         ids=["tcp", "ipc"])
async def test_relay_receives_zmq_batches_and_counts_gaps(tmp_path: Path,
                                                          endpoint_in: Callable[[Path], str]) -> None:
    import zmq
    import zmq.asyncio

    endpoint = endpoint_in(tmp_path)
    publisher = zmq.asyncio.Context.instance().socket(zmq.PUB)
    publisher.bind(endpoint)
    relay = KvEventRelay(endpoint)
    await relay.start()
    received = []

    async def collect() -> None:
        async for batch in relay.batches.listen():
            received.append(batch)

    collector = asyncio.create_task(collect())
    await asyncio.sleep(0)
    try:
        for seq in (0, 1, 3):  # 2 is lost
            for _ in range(50):  # ZMQ's slow joiner: resend until the subscription is live
                await publisher.send_multipart(sglang_frame(seq, [["BlockStored", [seq + 100], None, [seq] * 16, 16,
                                                                   None, None]]))
                await asyncio.sleep(0.05)
                if received and received[-1].events[0].block_hashes == chain_hashes([seq] * 16, 16):
                    break
        collector.cancel()
        assert [b.events[0].block_hashes for b in received] == [chain_hashes([seq] * 16, 16) for seq in (0, 1, 3)]
        assert relay.gaps == 1 and relay.last_seq == 3 and relay.batches_heard >= 3
    finally:
        await relay.stop()
        publisher.close(linger=0)


def test_cached_token_counts_outside_the_prompt_are_clamped() -> None:
    # SGLang's dLLM mode reported -256 cached tokens on the H100; a count above the prompt is not possible either.
    assert cached_tokens_of({"cached_tokens": -256}, prompt_tokens=12) == 0
    assert cached_tokens_of({"cached_tokens": 40}, prompt_tokens=12) == 12
    assert cached_tokens_of({"cached_tokens": 8}, prompt_tokens=12) == 8
    assert cached_tokens_of({}, prompt_tokens=12) == 0


def test_every_guided_constraint_maps_onto_sglang_sampling_params() -> None:
    def params(guided: GuidedDecoding) -> dict[str, object]:
        return sampling_params(GenerateRequest("g", [1], guided=guided))

    assert params(GuidedDecoding(regex="a+"))["regex"] == "a+"
    assert params(GuidedDecoding(choice=["yes", "no (never)"]))["regex"] == r"(yes)|(no \(never\))"
    assert params(GuidedDecoding(grammar='root ::= "x"'))["ebnf"] == 'root ::= "x"'


def test_lora_and_expert_settings_reach_sglang_and_bad_ones_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_SGLANG_ENABLE_LORA", "true")
    monkeypatch.setenv("CONVEYOR_SGLANG_LORA_TARGET_MODULES", '["q_proj", "v_proj"]')
    monkeypatch.setenv("CONVEYOR_SGLANG_ENABLE_EPLB", "true")
    monkeypatch.setenv("CONVEYOR_SGLANG_EXPERT_DISTRIBUTION_RECORDER_MODE", "per_pass")
    args = server_args(SGLangEngineConfig(model_path="/models/moe"), kv_events_publish="ipc:///k", bootstrap_port=2)
    assert {key: args[key] for key in ("enable_lora", "lora_target_modules", "max_lora_rank", "enable_eplb",
                                       "expert_distribution_recorder_mode")} == {
        "enable_lora": True, "lora_target_modules": ["q_proj", "v_proj"], "max_lora_rank": 64, "enable_eplb": True,
        "expert_distribution_recorder_mode": "per_pass"}
    plain = server_args(SGLangEngineConfig(model_path="/models/x", enable_lora=False, enable_eplb=False,
                                           expert_distribution_recorder_mode=None), "ipc:///k", 2)
    assert not {"enable_lora", "enable_eplb", "expert_distribution_recorder_mode"} & plain.keys()
    monkeypatch.setenv("CONVEYOR_SGLANG_EXPERT_DISTRIBUTION_RECORDER_MODE", "sometimes")
    with pytest.raises(ValidationError, match="expert_distribution_recorder_mode"):
        SGLangEngineConfig(model_path="/models/moe")


async def test_lora_on_an_sglang_engine_started_without_it_is_refused_with_the_setting_to_change() -> None:
    engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", enable_lora=False))
    with pytest.raises(UnsupportedOption, match="CONVEYOR_SGLANG_ENABLE_LORA"):
        await engine.load_lora("a", "/adapters/a")
    with pytest.raises(UnsupportedOption, match="not loaded"):
        await anext(engine.generate(GenerateRequest("r", [1, 2], lora_name="a")))


async def test_the_expert_recorder_is_refused_unless_the_engine_started_with_one() -> None:
    # On the H100 SGLang's scheduler died on start_expert_distribution_record without a recorder mode.
    engine = SGLangEngine(SGLangEngineConfig(model_path="/models/x", expert_distribution_recorder_mode=None,
                                             enable_eplb=False))
    with pytest.raises(UnsupportedOption, match="EXPERT_DISTRIBUTION_RECORDER_MODE"):
        await engine.record_experts(ExpertRecording.START)


def test_the_relay_publishes_sglangs_blocks_under_the_keys_a_router_computes() -> None:
    # SGLang's own block hashes are private ids; a router hashes prompts with schemas/kv_hashing.py.
    prompt = list(range(1000, 1048))  # three pages of 16
    relay = KvEventRelay("tcp://127.0.0.1:1")
    first = decode_event_frames(sglang_frame(0, [["BlockStored", [-5, 6], None, prompt[:32], 16, None, None]]))
    second = decode_event_frames(sglang_frame(1, [["BlockStored", [7], 6, prompt[32:], 16, None, None]]))
    assert first is not None and second is not None
    keys = chain_hashes(prompt, 16)
    stored = relay.translated(first[1]).events + relay.translated(second[1]).events
    assert [e.block_hashes for e in stored] == [keys[:2], keys[2:]]  # type: ignore[union-attr]
    assert [e.parent_block_hash for e in stored] == [None, keys[1]]  # type: ignore[union-attr]
    # Removals name SGLang's hashes; they leave as ours. A chain on a block never seen cannot be keyed: dropped.
    later = decode_event_frames(sglang_frame(2, [["BlockRemoved", [6, 999], None],
                                                 ["BlockStored", [8], 424242, prompt[:16], 16, None, None],
                                                 ["BlockStored", [9], None, prompt[:16], 16, 3, None]]))  # an adapter's
    assert later is not None
    (removed,) = relay.translated(later[1]).events
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [keys[1]]
    cleared = decode_event_frames(sglang_frame(3, [["AllBlocksCleared"]]))
    assert cleared is not None and isinstance(relay.translated(cleared[1]).events[0], AllBlocksCleared)
    assert len(relay.keys) == 0


def test_an_engine_without_sglangs_tokenizer_leaves_stop_strings_to_the_worker() -> None:
    config = SGLangEngineConfig(model_path="/m", skip_tokenizer_init=True)
    assert server_args(config, 1, 2)["skip_tokenizer_init"] is True
    assert "skip_tokenizer_init" not in server_args(SGLangEngineConfig(model_path="/m"), "ipc:///k", 2)
    request = GenerateRequest("r", [1, 2], stop=StopConditions(stop=["END"], stop_token_ids=[7]))
    params = sampling_params(request, stop_strings=False)
    assert "stop" not in params and params["stop_token_ids"] == [7]
    assert sampling_params(request)["stop"] == ["END"]


def test_what_needs_sglangs_tokenizer_is_named_and_the_rest_passes() -> None:
    def needed(**fields: object) -> str | None:
        return needs_sglang_tokenizer(GenerateRequest("r", [1], **fields))  # type: ignore[arg-type]

    assert needed() is None
    assert needed(stop=StopConditions(stop=["x"], stop_token_ids=[3], ignore_eos=True)) is None
    assert needed(guided=GuidedDecoding(regex="[ab]")) == "guided decoding"
    assert needed(stop=StopConditions(min_tokens=4)) == "min_tokens"
    assert needed(image_rows=[[0.0]]) == "images"
    assert needed(session=SessionRef(id="s"), stop=StopConditions(stop=["x"])) == "stop strings in a session"
    assert needed(session=SessionRef(id="s")) is None


def own_text_of(stop: list[str]) -> tuple[OwnText, object]:
    decoder = own_decoder(str(bundled_smollm2()))
    return OwnText(decoder, GenerateRequest("r", [1], stop=StopConditions(stop=stop))), decoder


def test_own_text_ends_the_generation_at_a_stop_string_split_across_tokens() -> None:
    own_text, decoder = own_text_of(["<END>"])
    tokens = decoder.encode("The answer is 42.<END> and more").ids  # type: ignore[attr-defined]
    shown, finish = "", None
    for token in tokens:
        text, reason, matched = own_text.step([token], None, None)
        shown += text
        if reason is not None:
            finish = (reason, matched)
            break
    assert shown == "The answer is 42."
    assert finish == (FinishReason.STOP, "<END>")


def test_own_text_keeps_sglangs_finish_and_releases_what_it_held_back() -> None:
    own_text, decoder = own_text_of(["<END>"])
    tokens = decoder.encode("Hello <EN").ids  # type: ignore[attr-defined]
    pieces = [own_text.step([token], None, None) for token in tokens[:-1]]
    last = own_text.step(tokens[-1:], FinishReason.LENGTH, None)
    assert "".join(text for text, _, _ in pieces) + last[0] == "Hello <EN"
    assert last[1:] == (FinishReason.LENGTH, None)
    assert all(reason is None for _, reason, _ in pieces)


def test_the_worker_decodes_as_the_models_own_tokenizer_does() -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(bundled_smollm2()))
    decoder = own_decoder(str(bundled_smollm2()))
    token_ids = reference.encode("Grüße, 世界! <|im_end|> done", add_special_tokens=False)
    for skip in (True, False):
        ours = decoder.decode(token_ids, skip_special_tokens=skip)
        assert ours == reference.decode(token_ids, skip_special_tokens=skip)


def test_a_relay_that_hears_no_kv_event_after_enough_requests_is_reported_once() -> None:
    from structlog.testing import capture_logs

    from workers.engines.sglang_engine import SilentEventsWatch

    def warnings_after(lengths: list[int], heard: int) -> list[dict[str, object]]:
        relay = KvEventRelay("ipc:///nowhere")
        relay.batches_heard = heard
        watch = SilentEventsWatch(relay, page_tokens=16, after_requests=8)
        with capture_logs() as logs:
            for num_tokens in lengths:
                watch.finished(num_tokens)
        return [entry for entry in logs if entry["event"] == "sglang.kv_events_silent"]

    silent = warnings_after([64] * 20, heard=0)
    assert len(silent) == 1 and silent[0]["requests"] == 8 and silent[0]["endpoint"] == "ipc:///nowhere"
    assert warnings_after([64] * 7, heard=0) == []  # too few yet
    assert warnings_after([20] * 20, heard=0) == []  # too short to fill two pages: SGLang may store none
    assert warnings_after([64] * 20, heard=1) == []  # the events arrive


def test_the_private_socket_folder_is_the_users_alone_and_short_enough_for_a_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from workers.engines.sglang_engine import private_socket_dir

    short = Path(tempfile.mkdtemp(prefix="s-", dir="/tmp"))
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    try:
        for temp_root, expected_parent in ((short, short), (deep, Path("/tmp"))):
            monkeypatch.setattr(tempfile, "tempdir", str(temp_root))
            folder = private_socket_dir()
            try:
                assert folder.stat().st_mode & 0o777 == 0o700
                assert len(str(folder / "kv-events").encode()) < 104
                assert folder.parent == expected_parent
            finally:
                folder.rmdir()
    finally:
        short.rmdir()
