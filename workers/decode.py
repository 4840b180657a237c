"""Decode stage: generate tokens and stream them to the client.

Consumes `DecodeTask` from `{ns}.work.decode.{model}`. Aggregated tasks (no bootstrap) run prompt
and generation on this engine; disaggregated tasks carry `{bootstrap_host, bootstrap_port,
bootstrap_room}` and the engine reads the prompt's KV from that prefill engine first. A task with images
carries the images and, once an encode worker ran them, `EncodedImages` (E/PD: the expanded prompt and a
`NixlHandle` to the rows); without one they are encoded here (EPD, when this worker has a vision path). The
rows replace the prompt's image tokens' embeddings.

Emits to the task's `reply_to`: `TokenChunk`s — token ids always, the text delta when the request
asked for text (whole characters only, matched stop strings hidden), an OpenAI
`chat.completion.chunk` when asked for that shape — then one `FinalFrame` with the normalized
finish reason and usage (prompt, completion, total, cached tokens). With `n` > 1 (aggregated only) the n
generations stream side by side, each chunk with its choice's `index` (and its own finish chunk in the OpenAI
shape); the others start once the first has streamed, so they share its prompt's KV through the prefix cache;
the final frame counts the prompt once and sums the completions.

Migration: every reply stream is journaled (bus/journal.py). A task redelivered because its replica
died or stopped mid-stream is taken over where it stopped: the tokens the client has are appended to
the prompt, `max_tokens` shrinks by as many, the stream goes on with its numbering and inbox, and the
final frame counts the `migrations`. Not migrated (retryable `worker_lost` error frame instead): guided
decoding (its grammar state cannot move), n > 1, a session's request, images on a worker without a vision path (their rows
were read once; with one, they are encoded here again), a request past the migration limit or whose
sequence is longer than the migration max. With migration
off (`--migration-limit 0`, no journal) every redelivered task gets that error, as what was streamed is
unknown; set the limit alike on every replica of a model.

Fails how: an option the engine cannot honour → `unsupported` error frame; an engine error →
`internal` error frame; a KV handoff that cannot complete (its prefill worker died) → the prompt runs on
this engine when it can (torch, mock; images encoded here), else a retryable `worker_lost` error frame;
image rows that cannot be read (their encode worker died) → the images, which the task keeps, are encoded
here, or `worker_lost` without a vision path; images for a worker without a vision path → `unsupported`;
bad media (EPD) → the encode stage's errors. A task given faster pools to retry on (bus/pools.py) goes to the next of
them instead of a retryable error frame, while nothing but heartbeats was streamed.
A `Cancel` (or the client vanishing, seen by the reply stream's liveness probe) aborts the engine
request at once, freeing its blocks, and the client gets `finish_reason: cancelled`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import structlog

from bus.consumer import Delivery
from bus.errors import RejectRequest
from bus.journal import Progress
from bus.metrics import (END_TO_END, INTER_TOKEN_LATENCY, MIGRATIONS, POOL_HANDOVERS, QUEUE_SECONDS, REQUESTS,
                         ROUTER_ACTUAL_TOKENS, TIME_TO_FIRST_TOKEN)
from bus.replies import ReplySender
from schemas.client import StreamFormat
from schemas.registry import Stage
from schemas.replies import ChatChunkDelta, ErrorCode, FinishReason, Usage
from schemas.sampling import SamplingOptions, StopConditions
from schemas.tasks import DecodeTask, PrefillTask
from workers.engines.protocol import (Engine, GenerateOutput, GenerateRequest, ResumedOutput, TransferFailed,
                                      UnsupportedOption)
from workers.media import EncodedPrompt, ImageInputs, MediaError
from workers.runtime import StageContext

log = structlog.get_logger(__name__)

# Any short prompt will do: the canary checks the engine answers, not what it answers.
CANARY_PROMPT = [1, 2, 3, 4]


@dataclass(frozen=True, slots=True)
class MigrationPolicy:
    # Takeovers of one request at most; 0 turns migration (and the reply journal) off.
    limit: int = 3
    # Prompt plus streamed tokens above this are not migrated (re-prefilling them costs too much).
    max_seq_len: int | None = None


class DecodeStage:
    task_type = DecodeTask

    def __init__(self, engine: Engine, model: str, images: ImageInputs | None = None,
                 migration: MigrationPolicy = MigrationPolicy()) -> None:
        self._engine = engine
        self.model = model
        self._images = images
        self._migration = migration
        self._context: StageContext | None = None
        # Observed per token: the labelled series are looked up once, not on every token.
        self._time_to_first_token = TIME_TO_FIRST_TOKEN.labels(model=model)
        self._inter_token_latency = INTER_TOKEN_LATENCY.labels(model=model)

    @property
    def journals_replies(self) -> bool:
        return self._migration.limit > 0

    @property
    def accepts_media(self) -> bool:
        """Whether images can be sent here without an encode worker (EPD: encoded in-process)."""
        return self._images is not None and self._images.encoder is not None

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def consumes_model(self) -> str:
        return self.model

    async def start(self, context: StageContext) -> None:
        self._context = context
        await self._engine.start()

    async def stop(self) -> None:
        await self._engine.shutdown()

    async def canary(self) -> None:
        await run_canary(self._engine, f"canary-{time.monotonic_ns()}")

    async def handle(self, task: DecodeTask, delivery: Delivery) -> None:
        QUEUE_SECONDS.labels(stage=Stage.DECODE.value).observe(delivery.queued_s)
        if self._context is not None:
            offer_failures_to_faster_pools(task, Stage.DECODE, self.model, delivery, self._context)
        if delivery.num_delivered > 1 and not delivery.reply.journaled:
            # Migration is off: what the dead replica streamed is unknown, and generating again would
            # repeat or contradict it. The client decides.
            await delivery.reply.fail(ErrorCode.WORKER_LOST, "the decode worker serving this request stopped; "
                                      "send the request again", retryable=True)
            REQUESTS.labels(stage=Stage.DECODE.value, model=self.model, outcome="worker_lost").inc()
            return
        resumed = delivery.progress if delivery.progress is not None and delivery.progress.streamed else None
        if resumed is not None and not await self._take_over(task, resumed, delivery):
            REQUESTS.labels(stage=Stage.DECODE.value, model=self.model, outcome="worker_lost").inc()
            return
        if task.request.lora_name is not None and self._context is not None and self._context.adapters is not None:
            await self._context.adapters.ensure(task.request.lora_name)
        # A migrated request's KV is gone with its prefill: this engine runs the longer prompt itself.
        bootstrap = task.bootstrap if resumed is None else None
        if bootstrap is not None:
            # The prompt's KV, images included, comes from the prefill engine.
            prompt: EncodedPrompt | None = EncodedPrompt(prompt_of(task))
        else:
            prompt = await resolve_images(self._images, task, delivery)
        if prompt is None:
            return
        generated = resumed.token_ids if resumed is not None else []
        request = GenerateRequest(
            request_id=task.request_id,
            token_ids=prompt.token_ids + generated,
            image_rows=prompt.rows,
            image_grids=prompt.grids,
            sampling=task.request.sampling,
            stop=_remaining(task.request.stop, len(generated)),
            output=task.request.output,
            guided=task.request.guided,
            bootstrap=bootstrap,
            priority=task.request.priority,
            lora_name=task.request.lora_name,
            session=task.request.session,
            resumed=ResumedOutput(resumed.token_ids, resumed.text) if resumed is not None else None,
        )
        async with delivery.reply as reply:
            if request.sampling.n > 1 or (request.sampling.best_of or 1) > 1:
                outcome = await self._stream_choices(task, request, reply, delivery)
            else:
                outcome = await self._stream(task, request, reply, delivery, len(generated))
        REQUESTS.labels(stage=Stage.DECODE.value, model=self.model, outcome=outcome).inc()
        END_TO_END.labels(model=self.model).observe(max(0.0, time.time() - task.header.created_at_s))

    async def _take_over(self, task: DecodeTask, progress: Progress, delivery: Delivery) -> bool:
        """Go on with a stream a dead replica started; False when it cannot move (the client was told)."""
        refusal = self._refusal(task, progress)
        # Either way the stream continues the predecessor's numbering.
        await delivery.reply.resume(progress)
        MIGRATIONS.labels(stage=Stage.DECODE.value, outcome=refusal or "migrated").inc()
        if refusal is not None:
            await delivery.reply.fail(ErrorCode.WORKER_LOST, f"the decode worker serving this request stopped and "
                                      f"the request cannot move ({refusal.replace('_', ' ')}); send it again",
                                      retryable=True)
            return False
        log.info("decode.migrated", streamed_tokens=len(progress.token_ids), migrations=delivery.reply.migrations)
        return True

    def _runs_prompts_itself(self, task: DecodeTask) -> bool:
        """Whether a disaggregated prompt can run on this engine instead of arriving as KV (its images, if
        any, encoded here)."""
        return self._engine.info.prefills_in_decode_role and (not task.request.media or self.accepts_media)

    def _refusal(self, task: DecodeTask, progress: Progress) -> str | None:
        request = task.request
        # What cannot be rebuilt here: a grammar's state, n parallel streams, images without a vision path
        # here (their rows were read once), a session's conversation (it stayed in the dead engine), or
        # (disaggregated) a prompt this decode engine cannot run itself.
        local_prefill = task.bootstrap is None or self._runs_prompts_itself(task)
        images_lost = bool(request.media) and not self.accepts_media
        several = request.sampling.n > 1 or request.sampling.best_of is not None
        if request.guided is not None or several or images_lost or not local_prefill or request.session is not None:
            return "not_migratable"
        if progress.migrations >= self._migration.limit:
            return "over_limit"
        seq_len = len(request.token_ids) + len(progress.token_ids)
        if self._migration.max_seq_len is not None and seq_len > self._migration.max_seq_len:
            return "over_max_seq_len"
        return None

    async def _stream(self, task: DecodeTask, request: GenerateRequest, reply: ReplySender, delivery: Delivery,
                      num_streamed: int) -> str:
        stopper = asyncio.create_task(_abort_when_stopped(self._engine, request.request_id, delivery, reply))
        shape = _Shaper(task, self.model, role_sent=num_streamed > 0)
        if request.stop.max_tokens == 0:
            # The predecessor streamed every token and died before its final frame.
            stopper.cancel()
            return await self._finish(GenerateOutput([], finish_reason=FinishReason.LENGTH), shape, reply, delivery,
                                      len(task.request.token_ids), num_streamed)
        last_token_s: float | None = None
        try:
            async for output in self._engine.generate(request):
                if output.token_ids or output.text:
                    now = time.time()
                    if last_token_s is None:
                        self._time_to_first_token.observe(max(0.0, now - task.header.created_at_s))
                    elif output.token_ids:
                        # A frame of several tokens (SGLang's stream interval) came one gap for all of them.
                        self._inter_token_latency.observe((now - last_token_s) / len(output.token_ids))
                    last_token_s = now
                if output.finished:
                    if task.predicted_cached_tokens is not None and not num_streamed:
                        ROUTER_ACTUAL_TOKENS.inc(output.cached_tokens)  # a router chose this replica for its cache
                    return await self._finish(output, shape, reply, delivery, len(task.request.token_ids), num_streamed)
                await reply.send_tokens(output.token_ids, **shape.chunk(output))
        except UnsupportedOption as error:
            raise RejectRequest(ErrorCode.UNSUPPORTED, str(error)) from error
        except TransferFailed as error:
            if delivery.cancelled.is_set():
                await reply.finish(FinishReason.CANCELLED, Usage.of(len(request.token_ids), 0))
                return FinishReason.CANCELLED.value
            if last_token_s is None and request.bootstrap is not None and self._runs_prompts_itself(task):
                # The prefill worker died (or lost the KV) before handing it over: run the prompt here.
                log.warning("decode.prefill_lost", error=str(error))
                MIGRATIONS.labels(stage=Stage.PREFILL.value, outcome="prefilled_by_decode").inc()
                stopper.cancel()
                prompt = await resolve_images(self._images, task, delivery)
                if prompt is None:
                    return "error"
                local = replace(request, bootstrap=None, token_ids=prompt.token_ids, image_rows=prompt.rows,
                                image_grids=prompt.grids)
                return await self._stream(task, local, reply, delivery, num_streamed)
            await reply.fail(ErrorCode.WORKER_LOST, f"KV handoff failed: {error}", retryable=True)
            return "error"
        finally:
            stopper.cancel()
        await reply.fail(ErrorCode.INTERNAL, "the engine ended the stream without a final output", retryable=True)
        return "error"

    async def _stream_choices(self, task: DecodeTask, request: GenerateRequest, reply: ReplySender,
                              delivery: Delivery) -> str:
        """`n` > 1 or `best_of`: several generations of the prompt. Choice 0 starts first and the others once it has
        streamed, so they find the prompt in the prefix cache instead of computing it again. With n alone each
        streams with its `index`; with best_of every candidate is held until all finished, and the n with the
        highest mean token log-probability are sent, as choices 0..n-1."""
        if request.bootstrap is not None:
            raise RejectRequest(ErrorCode.UNSUPPORTED, "n > 1 and best_of run on aggregated decode workers (the "
                                "prompt's KV arrives once, for one generation)")
        sampling = request.sampling
        num_candidates = sampling.best_of or sampling.n
        ranked = num_candidates > sampling.n
        # Ranking needs each token's log-probability, asked for whether or not the client wants them.
        output = request.output.model_copy(update={"logprobs": True}) if ranked else request.output
        choices = [replace(request, request_id=f"{request.request_id}.{index}", output=output,
                           sampling=sampling.model_copy(update={
                               "n": 1, "best_of": None, "seed": None if sampling.seed is None else sampling.seed + index}))
                   for index in range(num_candidates)]
        prompt_cached = asyncio.Event()
        finals: dict[int, GenerateOutput] = {}
        held: dict[int, list[GenerateOutput]] = {index: [] for index in range(num_candidates)}

        async def run(index: int) -> None:
            shape = _Shaper(task, self.model, index=index)
            stopper = asyncio.create_task(_abort_when_stopped(self._engine, choices[index].request_id, delivery, reply))
            try:
                if index:
                    await prompt_cached.wait()
                async for output in self._engine.generate(choices[index]):
                    prompt_cached.set()
                    if output.finished:
                        finals[index] = output
                    if ranked:
                        held[index].append(output)
                    else:
                        await _send_choice(reply, shape, output)
                    if output.finished:
                        return
            finally:
                prompt_cached.set()  # choice 0 failed before streaming: the others go on their own
                stopper.cancel()

        try:
            # A task group: one choice failing stops the others (their engine requests are aborted).
            async with asyncio.TaskGroup() as group:
                for index in range(len(choices)):
                    group.create_task(run(index))
        except* UnsupportedOption as errors:
            raise RejectRequest(ErrorCode.UNSUPPORTED, str(errors.exceptions[0])) from None
        if ranked and len(finals) == num_candidates:
            keep_logprobs = request.output.logprobs
            for rank, index in enumerate(sorted(held, key=lambda i: -_mean_logprob(held[i]))[:sampling.n]):
                shape = _Shaper(task, self.model, index=rank)
                for output in held[index]:
                    await _send_choice(reply, shape, output if keep_logprobs else replace(output, logprobs=None))
        return await self._finish_choices(finals, len(choices), len(request.token_ids), reply)

    async def _finish_choices(self, finals: dict[int, GenerateOutput], num_choices: int, prompt_tokens: int,
                              reply: ReplySender) -> str:
        """One final frame for the n choices: the prompt counted once (its cached share as the first choice found
        it), their completion tokens summed; `length` if any choice was cut, `cancelled` if any was stopped."""
        failed = [output for output in finals.values() if output.finish_reason == FinishReason.ERROR]
        if failed or len(finals) < num_choices:
            await reply.fail(ErrorCode.INTERNAL, (failed[0].error or "engine error") if failed else "a choice ended early")
            return "error"
        reasons = {output.finish_reason for output in finals.values()}
        reason = next((r for r in (FinishReason.CANCELLED, FinishReason.LENGTH) if r in reasons), FinishReason.STOP)
        usage = Usage.of(prompt_tokens, sum(output.completion_tokens for output in finals.values()),
                         finals[0].cached_tokens)
        await reply.finish(reason, usage)
        return reason.value

    async def _finish(self, output: GenerateOutput, shape: _Shaper, reply: ReplySender, delivery: Delivery,
                      prompt_tokens: int, num_streamed: int) -> str:
        assert output.finish_reason is not None
        if output.finish_reason == FinishReason.ERROR:
            await reply.fail(ErrorCode.INTERNAL, output.error or "engine error")
            return "error"
        # After a migration the engine saw the streamed tokens as prompt; the client's usage counts them
        # as completion, as they were.
        usage = (Usage.of(output.prompt_tokens, output.completion_tokens, output.cached_tokens) if not num_streamed
                 else Usage.of(prompt_tokens, num_streamed + output.completion_tokens,
                               min(output.cached_tokens, prompt_tokens)))
        if output.token_ids or output.text or shape.wants_openai:
            await reply.send_tokens(output.token_ids, **shape.chunk(output, final_reason=output.finish_reason, usage=usage))
        await reply.finish(output.finish_reason, usage, output.matched_stop)
        return output.finish_reason.value


class _Shaper:
    """Turns engine outputs into the chunk fields the request asked for."""

    def __init__(self, task: DecodeTask, model: str, role_sent: bool = False, index: int = 0) -> None:
        self._index = index
        self._format = task.header.stream_format
        self._request_id = task.request_id
        self._model = model
        self._created = int(task.header.created_at_s)
        self._sent_role = role_sent

    @property
    def index(self) -> int:
        return self._index

    @property
    def wants_openai(self) -> bool:
        return self._format == StreamFormat.OPENAI

    def chunk(self, output: GenerateOutput, final_reason: FinishReason | None = None,
              usage: Usage | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"logprobs": output.logprobs}
        if self._format == StreamFormat.TOKENS:
            return fields
        fields["text"] = output.text
        if self._format == StreamFormat.OPENAI:
            fields["openai"] = ChatChunkDelta(
                id=self._request_id, created=self._created, model=self._model, index=self._index,
                content=output.text or None, role=None if self._sent_role else "assistant",
                finish_reason=final_reason.value if final_reason else None, usage=usage,
            )
            self._sent_role = True
        return fields


async def _send_choice(reply: ReplySender, shape: _Shaper, output: GenerateOutput) -> None:
    """One choice's delta, or its end: the OpenAI shape gives each choice a finish chunk of its own."""
    if not output.finished:
        await reply.send_tokens(output.token_ids, index=shape.index, **shape.chunk(output))
    elif output.token_ids or output.text or shape.wants_openai:
        await reply.send_tokens(output.token_ids, index=shape.index, **shape.chunk(output, final_reason=output.finish_reason))


def _mean_logprob(outputs: list[GenerateOutput]) -> float:
    """How likely a candidate is, per token: OpenAI's best_of criterion."""
    logprobs = [entry.logprob for output in outputs for entry in output.logprobs or []]
    return sum(logprobs) / len(logprobs) if logprobs else float("-inf")


def _remaining(stop: StopConditions, num_streamed: int) -> StopConditions:
    """The stop conditions left after `num_streamed` tokens were streamed (by a dead replica)."""
    if not num_streamed:
        return stop
    max_tokens = None if stop.max_tokens is None else max(0, stop.max_tokens - num_streamed)
    return stop.model_copy(update={"max_tokens": max_tokens, "min_tokens": max(0, stop.min_tokens - num_streamed)})


def prompt_of(task: DecodeTask | PrefillTask) -> list[int]:
    """The prompt as the engine runs it: with each image placeholder expanded, once encoded."""
    return task.encoded_images.token_ids if task.encoded_images is not None else task.request.token_ids


async def resolve_images(images: ImageInputs | None, task: DecodeTask | PrefillTask,
                         delivery: Delivery) -> EncodedPrompt | None:
    """The prompt and image rows to run: read over NIXL (E/PD, E/P/D) or encoded here (EPD, or when the
    rows cannot be read). None when the client was already told why not (retryable `worker_lost`)."""
    if images is None:
        if task.request.media:
            raise RejectRequest(ErrorCode.UNSUPPORTED, "this worker has no image path; start encode workers for the model")
        return EncodedPrompt(task.request.token_ids)
    try:
        return await images.resolve(task.request_id, task.request.token_ids, task.request.media, task.encoded_images,
                                    first_delivery=delivery.num_delivered == 1)
    except MediaError as error:
        raise RejectRequest(error.code, str(error)) from error
    except TransferFailed as error:
        await delivery.reply.fail(ErrorCode.WORKER_LOST, f"image embeddings could not be read: {error}", retryable=True)
        return None


async def _abort_when_stopped(engine: Engine, request_id: str, delivery: Delivery, reply: ReplySender) -> None:
    """Abort the engine request when it is cancelled or its client is gone."""
    waits = [asyncio.ensure_future(delivery.cancelled.wait()), asyncio.ensure_future(reply.client_gone.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        log.info("decode.aborting", reason="cancelled" if delivery.cancelled.is_set() else "client gone")
        await engine.abort(request_id)
    finally:
        for wait in waits:
            wait.cancel()


async def run_canary(engine: Engine, request_id: str) -> None:
    """A 1-token request through the engine: the health check behind /ready. It samples as the engine does by default:
    a greedy request batched with live ones would put SGLang's whole running batch on its slower top-k sampling path
    until the batch empties (its sampling flags are merged in, never cleared)."""
    request = GenerateRequest(request_id, CANARY_PROMPT, SamplingOptions(), StopConditions(max_tokens=1),
                              health_check=True)
    async for output in engine.generate(request):
        if output.finished:
            if output.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
                raise RuntimeError(f"canary finished with {output.finish_reason}: {output.error}")
            return
    raise RuntimeError("canary stream ended without a final output")


# Failures of a worker or its engine, not of the request: another pool may well succeed.
_WORKER_FAILURES = frozenset({ErrorCode.INTERNAL, ErrorCode.OVERLOADED, ErrorCode.WORKER_LOST, ErrorCode.TIMEOUT})


def offer_failures_to_faster_pools(task: DecodeTask | PrefillTask, stage: Stage, model: str, delivery: Delivery,
                                   context: StageContext) -> None:
    """A task with faster pools to retry on (bus/pools.py): a failure of this worker or its engine before any output
    is not sent to the client; the task goes to the next pool, numbering the stream on from the heartbeats sent
    here. A refusal of the request itself (invalid, unsupported, too long) would fail there too: it is not moved."""
    if not task.retry_pools:
        return

    async def hand_over(code: ErrorCode, message: str) -> bool:
        if code not in _WORKER_FAILURES:
            return False
        pool = task.retry_pools[0]
        header = task.header.model_copy(update={"first_reply_seq": delivery.reply.frames_sent})
        moved = task.model_copy(update={"header": header, "retry_pools": task.retry_pools[1:],
                                        "predicted_cached_tokens": None})
        try:
            await context.publisher.publish(stage, moved, task.request_id, delivery.trace, model=model, pool=pool,
                                            msg_id=f"{task.request_id}:pool:{pool}")
        except Exception as error:  # the client gets the failure itself instead
            log.warning("pools.hand_over_failed", pool=pool, error=repr(error))
            return False
        POOL_HANDOVERS.labels(stage=stage.value, pool=pool).inc()
        log.info("pools.handed_over", to_pool=pool, code=code.value, reason=message)
        return True

    delivery.reply.hand_over_failures(hand_over)
