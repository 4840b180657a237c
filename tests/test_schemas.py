"""The wire contract: every message survives msgpack both ways, bad values are refused."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from schemas.client import (
    CLIENT_REQUEST,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    ImagePart,
    ImageRequest,
    MediaUrl,
    ResponseFormat,
    StreamFormat,
    TextPart,
    VideoPart,
)
from schemas.codec import WIRE_VERSION_HEADER, WireVersionMismatch, check_wire_version, decode, decode_as, encode
from schemas.control import Cancel
from schemas.export import all_schemas
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from schemas.registry import BootstrapEndpoint, KvCapacity, ServingMode, Stage, WorkerCard
from schemas.replies import (
    REPLY_FRAME,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    Embedding,
    EmbeddingResult,
    ErrorCode,
    ErrorFrame,
    FinalFrame,
    FinishReason,
    Heartbeat,
    ImageData,
    ImageProgress,
    ImageResult,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from schemas.sampling import GuidedDecoding, OutputOptions, SamplingOptions, StopConditions
from schemas.tasks import (
    BootstrapInfo,
    DecodeTask,
    EncodedImages,
    EmbedTask,
    EncodeTask,
    ImageTask,
    MediaItem,
    NixlHandle,
    PrefillTask,
    PreprocessedRequest,
    TaskHeader,
)

HEADER = TaskHeader(request_id="req-1", reply_to="_INBOX.abc", created_at_s=1700000000.5)
PREPROCESSED = PreprocessedRequest(
    model="SmolLM2-135M-Instruct",
    token_ids=[1, 2, 3],
    sampling=SamplingOptions(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, frequency_penalty=0.1, presence_penalty=-0.1,
        repetition_penalty=1.1, seed=7, n=2,
    ),
    stop=StopConditions(max_tokens=64, min_tokens=2, stop=["\n\n"], stop_token_ids=[2], ignore_eos=True),
    output=OutputOptions(logprobs=True, top_logprobs=3),
    guided=GuidedDecoding(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}),
    eos_token_ids=[2],
    media=[MediaItem(modality="image", source=MediaUrl(url="http://example.test/cat.png"))],
    priority=3,
)
NIXL = NixlHandle(agent_name="enc-1", agent_metadata=b"\x00\x01meta", serialized_descriptors=b"\x02desc",
                  shape=[1, 576, 896], dtype="bfloat16")

EVERY_MESSAGE: list[BaseModel] = [
    ChatRequest(
        request_id="r1", reply_to="_INBOX.r1", model="m", stream_format=StreamFormat.OPENAI,
        messages=[
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content=[
                TextPart(text="what is this?"),
                ImagePart(image_url=MediaUrl(url="data:image/png;base64,AAAA", detail="low")),
                VideoPart(video_url=MediaUrl(url="file:///tmp/v.mp4")),
            ]),
        ],
        temperature=0.0, max_tokens=16, stop=["END"], logprobs=True, top_logprobs=2, seed=1,
        response_format=ResponseFormat(type="json_schema", json_schema={"type": "object"}),
    ),
    CompletionRequest(request_id="r2", reply_to="_INBOX.r2", model="m", prompt=[1, 2, 3], stop="x"),
    CompletionRequest(request_id="r3", reply_to="_INBOX.r3", model="m", prompt="Once upon"),
    EmbeddingRequest(request_id="r4", reply_to="_INBOX.r4", model="e", input=["a", "b"], encoding_format="base64"),
    ImageRequest(request_id="r5", reply_to="_INBOX.r5", model="sd", prompt="a red fox", n=2, size="512x512",
                 response_format="url", seed=7, num_inference_steps=20, guidance_scale=5.0),
    EncodeTask(header=HEADER, request=PREPROCESSED, next_stage="prefill"),
    PrefillTask(header=HEADER, request=PREPROCESSED, bootstrap_room=2**63 - 1,
                encoded_images=EncodedImages(token_ids=[1, 7, 7, 2], rows=NIXL)),
    DecodeTask(header=HEADER, request=PREPROCESSED,
               bootstrap=BootstrapInfo(bootstrap_host="10.0.0.2", bootstrap_port=8998, bootstrap_room=12345),
               encoded_images=EncodedImages(token_ids=[1, 7, 7, 2])),
    EmbedTask(header=HEADER, model="e", inputs=[[1, 2], [3]], dimensions=128),
    ImageTask(header=HEADER, model="sd", prompt="a red fox", negative_prompt="blur", n=1, size="auto",
              response_format="b64_json", seed=None, num_inference_steps=50, guidance_scale=7.5),
    TokenChunk(request_id="r1", seq=0, token_ids=[5, 6], text="hé", index=1,
               logprobs=[TokenLogprob(token_id=5, logprob=-0.1, top=[TopLogprob(token_id=9, logprob=-2.0)])],
               openai=ChatCompletionChunk(id="r1", created=1, model="m",
                                          choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content="hé"))])),
    Heartbeat(request_id="r1", seq=1),
    FinalFrame(request_id="r1", seq=2, finish_reason=FinishReason.LENGTH, usage=Usage.of(10, 16, 8), matched_stop=2),
    ErrorFrame(request_id="r1", seq=0, code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, message="too long", retryable=False),
    EmbeddingResult(request_id="r4", seq=0, model="e",
                    data=[Embedding(index=0, vector=[0.1, 0.2]), Embedding(index=1, vector=b"\x00\x00\x80?")],
                    usage=Usage.of(4, 0)),
    ImageProgress(request_id="r5", seq=0, step=3, num_steps=20),
    ImageData(request_id="r5", seq=1, index=0, png=b"\x89PNG...", last=False),
    ImageData(request_id="r5", seq=2, index=1, url="file:///srv/images/r5-1.png"),
    ImageResult(request_id="r5", seq=3, model="sd", num_images=2, width=512, height=512, seed=7),
    Cancel(request_id="r1", reason="user pressed stop", sent_at_s=1700000001.0),
    KvEventBatch(worker_id="decode-a", seq=4, ts=1.5, data_parallel_rank=1, events=[
        BlockStored(block_hashes=[-5, 2**64 - 1], parent_block_hash=None, token_ids=list(range(32)), block_size=16),
        BlockRemoved(block_hashes=[-5], medium="GPU"),
        AllBlocksCleared(),
    ]),
    WorkerCard(worker_id="decode-host-1", stage=Stage.DECODE, model="m", mode=ServingMode.DISAGGREGATED,
               engine="torch", host="host", pid=1, started_at_s=1.0, metrics_url="http://host:9100/metrics",
               bootstrap=BootstrapEndpoint(host="host", port=8998),
               kv=KvCapacity(block_size=16, total_blocks=100, used_blocks=3), context_length=8192, ready=True,
               wire_version=1),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_msgpack(message: BaseModel) -> None:
    assert decode(encode(message), type(message)) == message


def test_client_requests_decode_through_the_union_by_kind() -> None:
    for message in EVERY_MESSAGE[:5]:
        assert decode_as(encode(message), CLIENT_REQUEST) == message


def test_reply_frames_decode_through_the_union_by_kind() -> None:
    frames = [m for m in EVERY_MESSAGE if type(m).__name__ in {"TokenChunk", "Heartbeat", "FinalFrame",
                                                                "ErrorFrame", "EmbeddingResult", "ImageProgress",
                                                                "ImageData", "ImageResult"}]
    assert len(frames) == 9
    for frame in frames:
        assert decode_as(encode(frame), REPLY_FRAME) == frame


def test_unknown_field_is_refused_rather_than_ignored() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        CLIENT_REQUEST.validate_python(
            {"kind": "chat", "request_id": "r", "reply_to": "_INBOX.r", "model": "m",
             "messages": [{"role": "user", "content": "hi"}], "temprature": 0.5}
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("max_tokens", 0), ("n", 0),
     ("frequency_penalty", 3.0), ("top_logprobs", 21)],
)
def test_out_of_range_sampling_values_are_refused(field: str, value: float) -> None:
    request = {"kind": "completion", "request_id": "r", "reply_to": "_INBOX.r", "model": "m", "prompt": "x"}
    with pytest.raises(ValidationError, match=field):
        CLIENT_REQUEST.validate_python({**request, field: value})


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_tokens"):
        StopConditions(max_tokens=4, min_tokens=5)


def test_guided_decoding_needs_exactly_one_constraint() -> None:
    with pytest.raises(ValidationError):
        GuidedDecoding()
    with pytest.raises(ValidationError):
        GuidedDecoding(json_schema={}, regex="a+")


@pytest.mark.parametrize(("field", "value"), [("n", 0), ("n", 11), ("size", "512"), ("size", "0x512"),
                                              ("size", "512x512x3"), ("num_inference_steps", 0), ("guidance_scale", -1)])
def test_out_of_range_image_options_are_refused(field: str, value: object) -> None:
    request = {"kind": "image", "request_id": "r", "reply_to": "_INBOX.r", "model": "sd", "prompt": "a fox"}
    with pytest.raises(ValidationError, match=field):
        CLIENT_REQUEST.validate_python({**request, field: value})


def test_reply_inbox_with_wildcards_is_refused() -> None:
    with pytest.raises(ValidationError, match="reply_to"):
        CompletionRequest(request_id="r", reply_to="_INBOX.>", model="m", prompt="x")


def test_finish_reasons_are_the_normalized_set() -> None:
    assert {reason.value for reason in FinishReason} == {"stop", "length", "cancelled", "error", "content_filter"}


def test_other_wire_version_is_refused_and_missing_header_accepted() -> None:
    check_wire_version(None)
    check_wire_version({WIRE_VERSION_HEADER: "1"})
    with pytest.raises(WireVersionMismatch):
        check_wire_version({WIRE_VERSION_HEADER: "99"})


def test_json_schema_exported_for_every_message() -> None:
    schemas = all_schemas()
    exported_titles = {schema.get("title") for schema in schemas.values()}
    for message in EVERY_MESSAGE:
        assert type(message).__name__ in exported_titles or type(message).__name__ in schemas
    assert schemas["ClientRequest"]["discriminator"]["propertyName"] == "kind"
    assert schemas["ReplyFrame"]["discriminator"]["propertyName"] == "kind"
