"""Several processes streaming one SGLang engine's outputs: the engine's *frontends*.

Why. Every token a GPU streams passes through the process that owns SGLang's tokenizer manager: it turns the
engine's batched outputs into per-request deltas, and our decode worker then frames and publishes each one. On the
H100 that one process reached 100% of a core at 128 streams and capped the token rate (docs/performance.md).
SGLang's own server splits the same work with `--tokenizer-worker-num N`: a `MultiTokenizerRouter` in the engine's
process hands each request's outputs to the `TokenizerWorker` process that sent it.

How. A decode worker started with `CONVEYOR_SGLANG_FRONTENDS=N` starts its engine in that mode, builds a
`TokenizerWorker` of its own, writes an `EngineHandle` (SGLang's port and server arguments) to a private file and
starts N-1 more processes: its own command line again, with `CONVEYOR_SGLANG_ATTACH` naming the file. Each of those
is an ordinary decode worker (its own NATS connection, worker id, card, /metrics and KV-event relay) whose engine
attaches to the running one instead of starting its own; replicas of a stage share one queue, so the work spreads
over all N. Each holds at most its share of the engine's running requests.

Failure. The frontends get SIGTERM when their parent dies (even by SIGKILL). A frontend that exits by itself is
logged; its requests move to another decode worker as any dead worker's do (workers/decode.py). On shutdown the
parent stops its frontends (each drains as a worker does) before it stops the engine they stream from.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from bus.lifecycle import dies_with_parent, stop_processes

log = structlog.get_logger(__name__)

# The variable a frontend's engine reads the handle's path from (SGLangEngineConfig.attach).
ATTACH_VARIABLE = "CONVEYOR_SGLANG_ATTACH"


@dataclass(frozen=True, slots=True)
class EngineHandle:
    """What a frontend process needs to attach to a running engine: SGLang's own argument objects (pickled, so the
    file is private to this user), the engine's facts a frontend cannot ask for, and how many frontends share it."""

    port_args: Any
    server_args: Any
    scheduler_info: dict[str, Any]
    kv_events_port: int
    num_frontends: int


def write_handle(handle: EngineHandle) -> Path:
    """The handle in a new file only this user reads; the caller removes it once its engine stops."""
    descriptor, name = tempfile.mkstemp(prefix="conveyor-sglang-", suffix=".handle")
    with os.fdopen(descriptor, "wb") as file:
        pickle.dump(handle, file)
    return Path(name)


def read_handle(path: Path) -> EngineHandle:
    with path.open("rb") as file:
        handle = pickle.load(file)
    if not isinstance(handle, EngineHandle):
        raise ValueError(f"{path} does not hold an engine handle")
    return handle


def attach_manager(handle: EngineHandle) -> Any:
    """A `TokenizerWorker` of the engine `handle` names, for this process: it sends requests through the engine's
    router and receives their outputs on an IPC name of its own."""
    import setproctitle
    from sglang.srt.managers.multi_tokenizer_mixin import get_tokenizer_worker_class

    port_args = _with_own_ipc_name(handle.port_args)
    title = setproctitle.getproctitle()
    manager = get_tokenizer_worker_class(handle.server_args)(handle.server_args, port_args)
    setproctitle.setproctitle(title)  # SGLang renames the process; `ps` should still show a conveyor worker
    manager.max_req_input_len = handle.scheduler_info["max_req_input_len"]
    if handle.scheduler_info.get("startup_time") is not None:
        manager.set_startup_time(handle.scheduler_info["startup_time"])
    return manager


def _with_own_ipc_name(port_args: Any) -> Any:
    """A copy of SGLang's port arguments where outputs come back on a new IPC name (what SGLang's HTTP workers do)."""
    import copy

    descriptor, name = tempfile.mkstemp(prefix="conveyor-sglang-", suffix=".ipc")
    os.close(descriptor)
    own = copy.copy(port_args)
    own.tokenizer_ipc_name = f"ipc://{name}"
    return own


def frontend_command() -> list[str]:
    """This process's own command line: a frontend is the same worker, attached (`sys.orig_argv` keeps `-m`)."""
    return [sys.executable, *sys.orig_argv[1:]]


class Frontends:
    """The frontend processes one engine started, watched until it stops them."""

    def __init__(self, processes: Sequence[subprocess.Popen[bytes]], handle_path: Path) -> None:
        self._processes = list(processes)
        self._handle_path = handle_path
        self._watch = asyncio.create_task(self._watch_exits(), name="frontends")

    @classmethod
    def start(cls, handle: EngineHandle, command: list[str]) -> Frontends:
        """`handle.num_frontends - 1` processes running `command` attached to the engine (this process is the first)."""
        path = write_handle(handle)
        env = {**os.environ, ATTACH_VARIABLE: str(path)}
        processes = [subprocess.Popen(command, env=env, preexec_fn=dies_with_parent(signal.SIGTERM))
                     for _ in range(handle.num_frontends - 1)]
        log.info("sglang.frontends_started", pids=[process.pid for process in processes])
        return cls(processes, path)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    async def _watch_exits(self, interval_s: float = 1.0) -> None:
        reported: set[int] = set()
        while True:
            for process in self._processes:
                if process.poll() is not None and process.pid not in reported:
                    reported.add(process.pid)
                    log.warning("sglang.frontend_exited", pid=process.pid, code=process.returncode)
            await asyncio.sleep(interval_s)

    async def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM each (each drains as a worker does), SIGKILL whichever outlives `grace_s`; then the handle goes."""
        self._watch.cancel()
        await stop_processes(self._processes, grace_s)
        self._handle_path.unlink(missing_ok=True)
