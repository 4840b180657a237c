"""`TorchEngine`: the embedded default engine, implementing `workers.engines.protocol.Engine`.

The model runs in one engine thread that loops: apply queued commands (new requests, aborts,
control operations) → schedule → forward → sample → deliver deltas. The asyncio side only enqueues
commands and reads per-request queues, so a long forward never blocks the event loop, and an abort
takes effect between two steps (its blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from schemas.registry import BootstrapEndpoint
from schemas.replies import FinishReason, TokenLogprob
from workers.engines.detokenizer import IncrementalDetokenizer
from workers.engines.torch_engine.grammar import GrammarCompiler, GrammarMatcher
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
)
from schemas.tasks import BootstrapInfo
from workers.engines.torch_engine.block_manager import BlockManager
from workers.engines.torch_engine.kv_transfer import (
    BootstrapServer,
    KvTransferAgent,
    RoomOffer,
    TransferFailed,
    fetch_offer,
    room_notification,
    room_of_notification,
)
from workers.engines.torch_engine.loader import DEFAULT_MODEL, ModelConfig, load_state_dict, resolve_model
from workers.engines.torch_engine.lora import install, read_peft_adapter, uninstall
from workers.engines.torch_engine.model import CausalLM
from workers.engines.torch_engine.runner import run_step
from workers.engines.torch_engine.sampler import Sampled, sample
from workers.engines.torch_engine.scheduler import Scheduler
from workers.engines.torch_engine.sequence import Sequence

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TorchEngineConfig:
    # A local Hugging Face directory, or the bundled default's name.
    model: str = DEFAULT_MODEL
    # "auto": CUDA when available, else CPU.
    device: str = "auto"
    # "auto": bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # "dummy": random weights from config.json (benchmarks and tests of size, not of output).
    load_format: str = "auto"
    block_size: int = 16
    kv_cache_tokens: int = 16384
    max_running_requests: int = 64
    # Token budget of one step; prompts longer than this are prefilled in chunks.
    max_step_tokens: int = 512
    enable_prefix_caching: bool = True
    # Longest prompt + output; defaults to the model's max_position_embeddings.
    context_length: int | None = None
    role: DisaggregationRole = DisaggregationRole.NONE
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 0
    # How long a prefill keeps a computed prompt's blocks for its decode engine to read.
    handoff_timeout_s: float = 60.0
    seed: int = 0
    # A session no request used for this long is forgotten (the bus's session bucket forgets it alike).
    session_idle_s: float = 600.0


@dataclass(slots=True)
class _Session:
    """A conversation this engine holds: every token so far (prompts and answers), whose KV the prefix cache keeps."""

    token_ids: list[int]
    used_at_s: float
    running: bool = False


class _Stream:
    """Where one request's deltas go: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[GenerateOutput] = asyncio.Queue()

    def put(self, output: GenerateOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)


class TorchEngine:
    def __init__(self, config: TorchEngineConfig = TorchEngineConfig()) -> None:
        self.config = config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.dtype = _dtype(config.dtype, self.device)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._sequences: dict[str, Sequence] = {}
        self._kv_events = KvEventFanout()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._model_dir: Path | None = None
        self._kv_cache: torch.Tensor | None = None
        self._profiler: torch.profiler.profile | None = None
        self._profile_dir: Path | None = None
        self.model: CausalLM | None = None
        self.model_config: ModelConfig | None = None
        self.tokenizer: Any = None
        self.block_manager: BlockManager | None = None
        self.scheduler: Scheduler | None = None
        # Until start() reads the model, the context length is what was configured (0: unknown).
        self._info = EngineInfo(name="torch", model=config.model, context_length=config.context_length or 0,
                                role=config.role)
        self._transfer: KvTransferAgent | None = None
        self._bootstrap: BootstrapServer | None = None
        # Prefill role: computed prompts waiting for their decode engine, by room, with a deadline.
        self._handoffs: dict[int, tuple[Sequence, float]] = {}
        # Decode role: requests still waiting for their prefill's offer, so an abort can stop the wait.
        self._receiving: dict[str, asyncio.Future[RoomOffer]] = {}
        # Guided decoding: compiled grammars of this model's tokenizer, made on the first guided request.
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        # LoRA adapters served (name -> path), and those unloaded while requests still run with them.
        self._loras: dict[str, str] = {}
        self._retiring: set[str] = set()
        self._lora_locks: dict[str, asyncio.Lock] = {}
        self._sessions: dict[str, _Session] = {}

    # ----- lifecycle -----------------------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        if self.config.role != DisaggregationRole.NONE:
            assert self._kv_cache is not None
            agent_name = f"{self.config.role.value}-{uuid.uuid4().hex[:12]}"
            self._transfer = KvTransferAgent(agent_name, self._kv_cache, self.config.block_size)
        if self.config.role == DisaggregationRole.PREFILL:
            self._bootstrap = BootstrapServer(self.config.bootstrap_host, self.config.bootstrap_port)
            await self._bootstrap.start()
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._bootstrap is not None:
            await self._bootstrap.stop()
        if self._transfer is not None:
            self._transfer.close()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        self._model_dir = resolve_model(self.config.model)
        self.model_config = ModelConfig.from_dir(self._model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        self.model = self._build_model(self._model_dir)
        context_length = self.config.context_length or self.model_config.max_position_embeddings
        num_blocks = self.config.kv_cache_tokens // self.config.block_size
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_running_requests, self.config.max_step_tokens)
        self._kv_cache = self._allocate_kv_cache()
        self._info = EngineInfo(
            name="torch",
            model=self.config.model,
            context_length=context_length,
            role=self.config.role,
            eos_token_ids=self.model_config.eos_token_ids,
            prefills_in_decode_role=True,
            max_running_requests=self.config.max_running_requests,
        )
        log.info("engine.loaded", model=str(self._model_dir), device=str(self.device), dtype=str(self.dtype),
                 kv_blocks=num_blocks, block_size=self.config.block_size)

    def _build_model(self, model_dir: Path) -> CausalLM:
        assert self.model_config is not None
        torch.manual_seed(self.config.seed)
        model = CausalLM(self.model_config)
        if self.config.load_format == "dummy":
            for parameter in model.parameters():
                torch.nn.init.uniform_(parameter, -1e-3 * 50, 1e-3 * 50)
        else:
            model.load_weights(load_state_dict(model_dir))
        return model.to(device=self.device, dtype=self.dtype).eval()

    def _allocate_kv_cache(self) -> torch.Tensor:
        assert self.model_config is not None and self.block_manager is not None
        config = self.model_config
        num_slots = self.block_manager.num_blocks * self.config.block_size
        shape = (config.num_layers, 2, num_slots, config.num_kv_heads, config.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ----- requests ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        if request.session is None:
            async for output in self._generate(request):
                yield output
            return
        session = self._session_for(request)
        request = replace(request, token_ids=session.token_ids + request.token_ids)
        completion: list[int] = []
        session.running = True
        try:
            async for output in self._generate(request):
                completion += output.token_ids
                if output.finished:
                    # Before the final output goes out: its reader stops reading there, and the next turn may come.
                    self._end_turn(request, session, completion if output.finish_reason in (
                        FinishReason.STOP, FinishReason.LENGTH) else None)
                yield output
        finally:
            if session.running:  # stopped early (cancelled, the reader went away): the turn is not kept
                self._end_turn(request, session, None)

    def _end_turn(self, request: GenerateRequest, session: _Session, completion: list[int] | None) -> None:
        """A finished turn joins the conversation (None: it did not finish; the conversation stays as it was)."""
        assert request.session is not None
        if completion is not None:
            session.token_ids = request.token_ids + completion
        session.running, session.used_at_s = False, time.monotonic()
        if request.session.closes:
            self._sessions.pop(request.session.id, None)

    def _session_for(self, request: GenerateRequest) -> _Session:
        """The session a request continues (opened when it is the first); refused when this engine does not hold it."""
        assert request.session is not None
        now_s = time.monotonic()
        for idle in [sid for sid, s in self._sessions.items() if not s.running and now_s - s.used_at_s > self.config.session_idle_s]:
            del self._sessions[idle]
        session = self._sessions.get(request.session.id)
        if session is None and not request.session.opens:
            raise UnsupportedOption(f"session {request.session.id!r} is not open on this engine (its worker restarted, "
                                    f"or it was idle over {self.config.session_idle_s:.0f} s): start a new session")
        if session is None:
            session = self._sessions[request.session.id] = _Session([], now_s)
        if session.running:
            raise UnsupportedOption(f"session {request.session.id!r} is running a request: a session takes one at a time")
        return session

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        self._check_supported(request)
        stream = _Stream(asyncio.get_running_loop())
        seq = self._new_sequence(request)
        if request.guided is not None:
            # Compiling a schema takes milliseconds to seconds: not on the event loop.
            seq.grammar = await asyncio.to_thread(self._grammar_for, request)
        if self.config.role == DisaggregationRole.DECODE and request.bootstrap is not None:
            await self._receive_prompt_kv(seq, stream, request.bootstrap)
        else:
            self._commands.put(lambda: self._admit(seq, stream))
        finished = False
        try:
            while not finished:
                output = await stream.queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                # The consumer stopped reading (cancelled, client gone): free the request's blocks.
                self._commands.put(lambda: self._abort_now(request.request_id))

    async def abort(self, request_id: str) -> None:
        receiving = self._receiving.get(request_id)
        if receiving is not None:
            receiving.cancel()  # decode role, still waiting for the prefill's offer
        self._commands.put(lambda: self._abort_now(request_id))

    async def _receive_prompt_kv(self, seq: Sequence, stream: _Stream, bootstrap: BootstrapInfo) -> None:
        """Decode role: read the prompt's KV from the prefill engine, then continue as if prefilled."""
        assert self._transfer is not None
        fetch = asyncio.ensure_future(fetch_offer(bootstrap, self.config.handoff_timeout_s))
        self._receiving[seq.request_id] = fetch
        try:
            offer = await fetch
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            raise TransferFailed(f"request {seq.request_id} aborted before its KV arrived") from None
        finally:
            self._receiving.pop(seq.request_id, None)
        if offer.num_prompt_tokens != seq.num_prompt_tokens or offer.layout.block_size != self.config.block_size:
            raise TransferFailed(
                f"room {bootstrap.bootstrap_room}: prefill offers {offer.num_prompt_tokens} tokens in blocks of "
                f"{offer.layout.block_size}, this request has {seq.num_prompt_tokens} in blocks of {self.config.block_size}"
            )
        blocks = await self._call(lambda: self._reserve(seq, stream))
        try:
            await asyncio.to_thread(
                self._transfer.read_blocks, offer, blocks, room_notification(bootstrap.bootstrap_room),
                self.config.handoff_timeout_s,
            )
        except BaseException:
            self._commands.put(lambda: self._abort_now(seq.request_id))
            raise
        self._commands.put(lambda: self._continue_after_transfer(seq, offer.first_token_id))

    def _reserve(self, seq: Sequence, stream: _Stream) -> list[int]:
        assert self.block_manager is not None
        if not self.block_manager.can_allocate(seq, seq.num_prompt_tokens):
            raise TransferFailed(f"no free KV blocks for a prompt of {seq.num_prompt_tokens} tokens")
        self.block_manager.allocate(seq, seq.num_prompt_tokens)
        self._streams[seq.request_id] = stream
        self._sequences[seq.request_id] = seq
        return list(seq.block_table)

    def _continue_after_transfer(self, seq: Sequence, first_token_id: int) -> None:
        assert self.block_manager is not None and self.scheduler is not None
        if seq.request_id not in self._sequences:
            return  # aborted while the blocks were in flight
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit_full_blocks(seq)
        self.scheduler.add_running(seq)
        self._advance(seq, Sampled(first_token_id, None))
        self._publish_events()

    def _check_supported(self, request: GenerateRequest) -> None:
        if request.sampling.n != 1:
            raise UnsupportedOption("the torch engine generates one completion per request (n=1)")
        if request.lora_name is not None and request.lora_name not in self._loras:
            raise UnsupportedOption(f"LoRA adapter {request.lora_name!r} is not loaded on this engine "
                                    f"(loaded: {', '.join(sorted(self._loras)) or 'none'})")
        if len(request.token_ids) >= self.info.context_length:
            raise UnsupportedOption(
                f"prompt of {len(request.token_ids)} tokens leaves no room in the context of {self.info.context_length}"
            )
        assert self.model_config is not None
        vocab_size = self.model_config.vocab_size
        num_image_tokens = sum(1 for token in request.token_ids if token >= vocab_size)
        num_rows = 0 if request.image_rows is None else int(request.image_rows.shape[0])
        # A decode engine of a disaggregated pair receives the prompt's KV: it never embeds the prompt.
        receives_kv = self.config.role == DisaggregationRole.DECODE and request.bootstrap is not None
        if num_image_tokens != num_rows and not receives_kv:
            raise UnsupportedOption(f"the prompt has {num_image_tokens} tokens outside the vocabulary of {vocab_size} "
                                    f"and {num_rows} image embedding rows; they must match")
        if num_rows and tuple(request.image_rows.shape[1:]) != (self.model_config.hidden_size,):
            raise UnsupportedOption(f"image rows of shape {list(request.image_rows.shape)} do not fit a model of "
                                    f"hidden size {self.model_config.hidden_size}")

    def _new_sequence(self, request: GenerateRequest) -> Sequence:
        assert self.model_config is not None
        generator = None
        if request.sampling.seed is not None:
            generator = torch.Generator().manual_seed(request.sampling.seed)
        return Sequence(
            request_id=request.request_id,
            token_ids=list(request.token_ids),
            num_prompt_tokens=len(request.token_ids),
            sampling=request.sampling,
            stop=request.stop,
            output=request.output,
            detokenizer=IncrementalDetokenizer.of_request(self.tokenizer, request),
            generator=generator,
            banned_before_min_tokens=tuple({*self.info.eos_token_ids, *request.stop.stop_token_ids}),
            bootstrap_room=request.bootstrap.bootstrap_room if request.bootstrap is not None else None,
            image_positions=[i for i, t in enumerate(request.token_ids) if t >= self.model_config.vocab_size]
            if request.image_rows is not None else [],
            image_rows=request.image_rows,
            lora_name=request.lora_name,
        )

    def _grammar_for(self, request: GenerateRequest) -> GrammarMatcher:
        assert request.guided is not None and self.model_config is not None
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
            matcher = self._grammars.matcher(request.guided)
        # A migrated request goes on from the tokens another engine generated under the same grammar.
        for token_id in request.resumed.token_ids if request.resumed is not None else []:
            matcher.accept(token_id)
        return matcher

    # ----- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        assert self.scheduler is not None
        while not self._stopping.is_set():
            if self._handoffs:
                self._settle_handoffs()
            self._run_commands(block=not self.scheduler.has_work and not self._handoffs)
            if self._retiring:
                self._retire_unused_loras()
            if self.scheduler.has_work and self._kv_cache is not None:
                try:
                    self._step()
                except Exception as error:  # a failed forward fails its batch, never the engine
                    log.exception("engine.step_failed")
                    self._fail_all(str(error))

    def _run_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self, seq: Sequence, stream: _Stream) -> None:
        assert self.scheduler is not None
        self._streams[seq.request_id] = stream
        self._sequences[seq.request_id] = seq
        self.scheduler.add(seq)

    def _abort_now(self, request_id: str) -> None:
        assert self.scheduler is not None
        handoff = next((room for room, (s, _) in self._handoffs.items() if s.request_id == request_id), None)
        if handoff is not None:
            seq, _ = self._handoffs.pop(handoff)
            self._end_handoff(seq, FinishReason.CANCELLED, None)
            return
        seq = self.scheduler.remove(request_id)
        if seq is None and request_id in self._sequences:
            # Decode role, blocks reserved but not yet running: release them too.
            seq = self._sequences[request_id]
            assert self.block_manager is not None
            self.block_manager.free(seq)
        self._sequences.pop(request_id, None)
        if seq is not None:
            self._withdraw_room(seq, "the request was cancelled during prefill")
        stream = self._streams.pop(request_id, None)
        if seq is not None and stream is not None:
            stream.put(self._final(seq, FinishReason.CANCELLED, [], ""))

    def _withdraw_room(self, seq: Sequence, reason: str) -> None:
        """Prefill role: tell a decode engine waiting on this prompt's room that it will not come."""
        if self._bootstrap is not None and seq.bootstrap_room is not None:
            self._bootstrap.fail(seq.bootstrap_room, reason)
            self._bootstrap.forget(seq.bootstrap_room, after_s=self.config.handoff_timeout_s)

    def _step(self) -> None:
        assert self.scheduler is not None and self.block_manager is not None and self.model is not None
        chunks = self.scheduler.schedule()
        if not chunks:
            self._fail_unschedulable()
            return
        logits = run_step(self.model, chunks, self._kv_cache, self.config.block_size)
        completing = [(row, chunk) for row, chunk in enumerate(chunks) if chunk.completes_prompt]
        sampled = sample(logits[[row for row, _ in completing]], [chunk.seq for _, chunk in completing]) if completing else []
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit_full_blocks(chunk.seq)
        for (_, chunk), token in zip(completing, sampled, strict=True):
            if self.config.role == DisaggregationRole.PREFILL and chunk.seq.bootstrap_room is not None:
                self._offer_handoff(chunk.seq, token)
            else:
                self._advance(chunk.seq, token)
        self._publish_events()

    def _offer_handoff(self, seq: Sequence, sampled: Sampled) -> None:
        """Prefill role: pin the computed prompt's blocks and offer them in the request's room."""
        assert self.scheduler is not None and self._bootstrap is not None and self._transfer is not None
        assert seq.bootstrap_room is not None
        self.scheduler.detach(seq)
        self._handoffs[seq.bootstrap_room] = (seq, time.monotonic() + self.config.handoff_timeout_s)
        self._bootstrap.offer(
            seq.bootstrap_room,
            RoomOffer(
                agent_name=self._transfer.name,
                agent_metadata_b64=base64.b64encode(self._transfer.metadata).decode(),
                layout=self._transfer.layout,
                block_ids=list(seq.block_table),
                num_prompt_tokens=seq.num_prompt_tokens,
                first_token_id=sampled.token_id,
            ),
        )
        seq.token_ids.append(sampled.token_id)

    def _settle_handoffs(self) -> None:
        """Free the blocks of rooms whose decode engine has read them, or that waited too long."""
        assert self._transfer is not None and self.block_manager is not None
        for message in self._transfer.notifications():
            room = room_of_notification(message)
            if room in self._handoffs:
                seq, _ = self._handoffs.pop(room)
                self._end_handoff(seq, FinishReason.LENGTH, None)
        now = time.monotonic()
        for room, (seq, deadline) in list(self._handoffs.items()):
            if deadline < now:
                del self._handoffs[room]
                self._end_handoff(seq, FinishReason.ERROR, f"no decode engine read room {room} within "
                                                            f"{self.config.handoff_timeout_s:.0f} s")

    def _end_handoff(self, seq: Sequence, reason: FinishReason, error: str | None) -> None:
        assert self.block_manager is not None and self._bootstrap is not None and seq.bootstrap_room is not None
        self.block_manager.free(seq)
        if error is not None:
            self._bootstrap.fail(seq.bootstrap_room, error)
        self._bootstrap.forget(seq.bootstrap_room, after_s=self.config.handoff_timeout_s if error else 0.0)
        self._sequences.pop(seq.request_id, None)
        stream = self._streams.pop(seq.request_id, None)
        if stream is not None:
            stream.put(self._final(seq, reason, seq.completion_token_ids, "", error=error))

    def _advance(self, seq: Sequence, sampled: Sampled) -> None:
        seq.token_ids.append(sampled.token_id)
        text = seq.detokenizer.add([sampled.token_id])
        finish, matched = self._stop_reason(seq, sampled.token_id)
        logprobs = [self._with_text(sampled.logprob)] if sampled.logprob is not None else None
        stream = self._streams.get(seq.request_id)
        if finish is None:
            if stream is not None:
                stream.put(GenerateOutput(token_ids=[sampled.token_id], text=text, logprobs=logprobs))
            return
        assert self.scheduler is not None
        self.scheduler.finish(seq)
        self._sequences.pop(seq.request_id, None)
        self._streams.pop(seq.request_id, None)
        if stream is not None:
            text += seq.detokenizer.flush()
            stream.put(self._final(seq, finish, [sampled.token_id], text, logprobs, matched))

    def _with_text(self, logprob: TokenLogprob) -> TokenLogprob:
        """The entry with each token's text (what OpenAI's responses show), decoded on its own; special tokens
        (EOS) show as "", as they do in the answer's text."""
        def text(token_id: int) -> str:
            return self.tokenizer.decode([token_id], skip_special_tokens=True)

        return logprob.model_copy(update={"token": text(logprob.token_id), "top": [
            top.model_copy(update={"token": text(top.token_id)}) for top in logprob.top]})

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[FinishReason | None, str | int | None]:
        completion = seq.num_completion_tokens
        if seq.detokenizer.matched_stop is not None:
            return FinishReason.STOP, seq.detokenizer.matched_stop
        if seq.grammar is not None and seq.grammar.finished:
            return FinishReason.STOP, None  # the constrained answer is complete (its stop token accepted)
        if completion >= seq.stop.min_tokens:
            if token in seq.stop.stop_token_ids:
                return FinishReason.STOP, token
            if not seq.stop.ignore_eos and token in self.info.eos_token_ids:
                return FinishReason.STOP, None
        if seq.stop.max_tokens is not None and completion >= seq.stop.max_tokens:
            return FinishReason.LENGTH, None
        if seq.num_tokens >= self.info.context_length:
            return FinishReason.LENGTH, None
        return None, None

    def _final(
        self,
        seq: Sequence,
        reason: FinishReason,
        token_ids: list[int],
        text: str,
        logprobs: list[Any] | None = None,
        matched: str | int | None = None,
        error: str | None = None,
    ) -> GenerateOutput:
        return GenerateOutput(
            token_ids=token_ids,
            text=text,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_completion_tokens,
            cached_tokens=seq.num_cached_tokens,
            logprobs=logprobs,
            matched_stop=matched,
            error=error,
        )

    def _fail_unschedulable(self) -> None:
        """Nothing fits although nothing runs: the first waiting request can never get its blocks."""
        assert self.scheduler is not None
        if self.scheduler.running or not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        self._fail(seq, f"request needs more KV blocks than the cache has ({self.block_manager.num_blocks})")

    def _fail_all(self, message: str) -> None:
        assert self.scheduler is not None
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self._fail(seq, message)

    def _fail(self, seq: Sequence, message: str) -> None:
        assert self.scheduler is not None
        self.scheduler.remove(seq.request_id)
        self._withdraw_room(seq, message)
        self._sequences.pop(seq.request_id, None)
        stream = self._streams.pop(seq.request_id, None)
        if stream is not None:
            stream.put(self._final(seq, FinishReason.ERROR, [], "", error=message))

    def _publish_events(self) -> None:
        assert self.block_manager is not None
        events = self.block_manager.take_events()
        if not events:
            return
        self._kv_events.publish(KvEventBatchOut(events=events, ts=time.time()))

    # ----- state and control ---------------------------------------------------------------------

    def load(self) -> EngineLoad:
        assert self.scheduler is not None and self.block_manager is not None
        manager = self.block_manager
        seen = manager.prompt_tokens_seen
        return EngineLoad(
            running_requests=len(self.scheduler.running),
            waiting_requests=len(self.scheduler.waiting),
            kv_block_size=manager.block_size,
            kv_total_blocks=manager.num_blocks,
            kv_used_blocks=manager.num_used_blocks,
            cache_hit_rate=manager.prompt_tokens_cached / seen if seen else 0.0,
            waiting_prompt_tokens=self.scheduler.waiting_prompt_tokens,
        )

    def kv_events(self) -> AsyncIterator[KvEventBatchOut]:
        return self._kv_events.listen()

    @property
    def bootstrap_endpoint(self) -> BootstrapEndpoint | None:
        return self._bootstrap.endpoint if self._bootstrap is not None else None

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        raise UnsupportedOption("the torch engine serves generation; embeddings come from the embedding worker")

    async def release_memory(self, tags: list[MemoryTag]) -> None:
        await self._call(lambda: self._release(tags))

    async def resume_memory(self, tags: list[MemoryTag]) -> None:
        await self._call(lambda: self._resume(tags))

    def _release(self, tags: list[MemoryTag]) -> None:
        assert self.scheduler is not None and self.block_manager is not None
        if self.scheduler.has_work:
            raise RuntimeError("release_memory needs an idle engine: deregister and drain first")
        if MemoryTag.KV_CACHE in tags:
            self.block_manager.clear_cache()
            self._publish_events()
            self._kv_cache = None
        if MemoryTag.WEIGHTS in tags:
            self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _resume(self, tags: list[MemoryTag]) -> None:
        assert self._model_dir is not None
        if MemoryTag.WEIGHTS in tags and self.model is None:
            self.model = self._build_model(self._model_dir)
        if MemoryTag.KV_CACHE in tags and self._kv_cache is None:
            self._kv_cache = self._allocate_kv_cache()

    async def start_profile(self, output_dir: Path) -> None:
        def begin() -> None:
            if self._profiler is not None:
                raise RuntimeError("a profile is already running")
            self._profile_dir = output_dir
            self._profiler = torch.profiler.profile(record_shapes=True)
            self._profiler.__enter__()

        await self._call(begin)

    async def stop_profile(self) -> None:
        def end() -> None:
            if self._profiler is None or self._profile_dir is None:
                raise RuntimeError("no profile is running")
            self._profiler.__exit__(None, None, None)
            self._profile_dir.mkdir(parents=True, exist_ok=True)
            self._profiler.export_chrome_trace(str(self._profile_dir / f"torch-engine-{int(time.time())}.json"))
            self._profiler = None

        await self._call(end)

    async def update_weights_from_disk(self, model_path: Path) -> None:
        def update() -> None:
            assert self.model is not None and self.block_manager is not None
            self.model.load_weights({k: v.to(self.dtype) for k, v in load_state_dict(model_path).items()})
            # Cached KV was computed with the old weights.
            self.block_manager.clear_cache()
            self._publish_events()
            self._model_dir = model_path

        await self._call(update)

    async def flush_cache(self) -> None:
        def flush() -> None:
            assert self.block_manager is not None
            if not self.block_manager.clear_cache():
                raise RuntimeError("cannot flush the prefix cache while requests are running")
            self._publish_events()

        await self._call(flush)

    # ----- LoRA adapters --------------------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> None:
        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            if self._loras.get(name) == path:
                return  # loaded already: loading is idempotent
            if name in self._loras or name in self._retiring:
                raise ValueError(f"adapter {name!r} is loaded from {self._loras.get(name, 'another path')} (or still "
                                 f"finishing its requests); unload it before loading it from {path}")
            assert self.model is not None, "the engine's weights are released"
            # Reading tensors from disk is not the engine thread's business; installing them is, between steps.
            adapter = await asyncio.to_thread(read_peft_adapter, Path(path), self.model, self.dtype, self.device)

            def add() -> None:
                assert self.model is not None
                install(self.model, name, adapter)
                self._loras[name] = path

            await self._call(add)
            log.info("engine.lora_loaded", name=name, path=path, rank=adapter.rank, layers=len(adapter.weights))

    async def unload_lora(self, name: str) -> None:
        def remove() -> None:
            if self._loras.pop(name, None) is not None:
                self._retiring.add(name)  # its weights go once no running request uses them
                self._retire_unused_loras()

        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            await self._call(remove)

    def loras(self) -> dict[str, str]:
        return dict(self._loras)

    async def record_experts(self, action: ExpertRecording) -> None:
        raise UnsupportedOption("the torch engine runs dense models: no experts to record (SGLang records MoE models)")

    def _retire_unused_loras(self) -> None:
        in_use = {seq.lora_name for seq in self._sequences.values()}
        for name in self._retiring - in_use:
            if self.model is not None:
                uninstall(self.model, name)
            self._retiring.discard(name)
            log.info("engine.lora_unloaded", name=name)

    async def _call(self, function: Callable[[], T]) -> T:
        """Run `function` in the engine thread, between two steps; re-raise what it raises."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(function())
            except Exception as error:
                future.set_exception(error)

        self._commands.put(run)
        return await asyncio.wrap_future(future)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
