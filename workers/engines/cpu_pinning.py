"""Hold each SGLang scheduler of a worker on CPUs of its own.

Why: with a small model SGLang's scheduler is a Python loop at 100% of a core, and its steps are the engine's token
rate. Left free beside a stack's other busy processes (gateways, processor, nats-server, the worker itself) it ran on
15-16 different CPUs over a 4-minute run. Held on two, it waited for a CPU 1.6% of its time where a free one beside it
waited 4.5% (docs/performance.md, twenty-ninth stop). The token rate gained little that could be told apart: the gap
first put down to moving (twenty-eighth stop) was the worker's canary (twenty-ninth). Only the loop is held there: the
scheduler's helper threads go to the other CPUs, where waking them cannot preempt it (held with it, ZMQ's I/O thread
did at every step's send).

A worker claims whole cores near the scheduler's GPU first (the CPUs the kernel lists as local to its PCI device: on a
machine of two sockets, a launch from the other socket crosses the link between them at every step), and among those
from the highest-numbered down (the kernel places new work on low numbers first), with one lock file per CPU, so that
workers sharing the lock directory (one host, or containers that mount it) take different cores. A claim lasts until
the worker process exits: the kernel drops its locks then.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SCHEDULER_TITLE = "sglang::scheduler"  # SGLang's process title for a scheduler (setproctitle)
DEFAULT_LOCK_DIR = Path(tempfile.gettempdir()) / "conveyor-cpus"
# Two, not one: a process the kernel places on one of them (nothing keeps others off) leaves the loop the other.
CPUS_PER_SCHEDULER = 2
# Claim nothing that would take more than a quarter of what this process may use: the stack's other processes need
# the rest more than the scheduler needs to stay put.
MAX_SHARE = 0.25


@dataclass
class CpuClaim:
    """CPUs this process holds for its schedulers, and the open lock files that keep other workers off them."""

    cpus: list[int]
    lock_fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self.lock_fds:
            os.close(fd)
        self.lock_fds.clear()


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,8' -> [0, 1, 2, 8]"""
    cpus: list[int] = []
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def physical_cores(allowed: set[int] | None = None) -> list[list[int]]:
    """Each physical core's logical CPUs (hyperthread siblings together, sorted), lowest core first; only cores all of
    whose CPUs are in `allowed` (default: every CPU the kernel shows)."""
    cores: set[tuple[int, ...]] = set()
    for cpu in range(os.cpu_count() or 1):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(tuple(parse_cpu_list(siblings.read_text())) if siblings.exists() else (cpu,))
    usable = (core for core in cores if allowed is None or set(core) <= allowed)
    return sorted((list(core) for core in usable), key=lambda core: core[0])


def _try_lock(lock_dir: Path, cpu: int) -> int | None:
    """An open, exclusively locked file for `cpu`, or None where another worker holds it."""
    fd = os.open(lock_dir / f"cpu{cpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def claim_order(cores: list[list[int]], near_cpus: set[int] | None) -> list[list[int]]:
    """`cores`, best first for a scheduler: wholly within `near_cpus` (its GPU's CPUs; None: unknown) before the
    rest, the highest-numbered first within each."""
    return sorted(cores, key=lambda core: (near_cpus is not None and not set(core) <= near_cpus, -core[0]))


def claim_cores(num_cpus: int, lock_dir: Path = DEFAULT_LOCK_DIR, allowed: set[int] | None = None,
                max_share: float = MAX_SHARE, near_cpus: set[int] | None = None) -> CpuClaim | None:
    """Whole cores of `allowed` (default: what this process may use), those within `near_cpus` first and the
    highest-numbered first, none held by another worker, until there are at least `num_cpus` CPUs; None where they
    cannot be found, or where `num_cpus` is more than `max_share` of `allowed`."""
    lock_dir.mkdir(parents=True, exist_ok=True)  # first: a directory that cannot be made is an error on any machine
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    if num_cpus > len(allowed) * max_share:
        return None
    claim = CpuClaim(cpus=[])
    for core in claim_order(physical_cores(allowed), near_cpus):
        if len(claim.cpus) >= num_cpus:
            break
        fds = [fd for cpu in core if (fd := _try_lock(lock_dir, cpu)) is not None]
        if len(fds) < len(core):  # part of this core is another worker's: leave all of it
            for fd in fds:
                os.close(fd)
            continue
        claim.cpus.extend(core)
        claim.lock_fds.extend(fds)
    if len(claim.cpus) < num_cpus:
        claim.release()
        return None
    claim.cpus.sort()
    return claim


def pci_device_dir(bus_id: str) -> Path:
    """sysfs's directory for a PCI device as nvidia-smi names it: nvidia-smi writes an 8-digit domain
    ("00000000:18:00.0"), sysfs a 4-digit one."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}")


def gpu_cpus_by_pid() -> dict[int, set[int]]:
    """pid -> the CPUs local to the GPU it computes on, for every process NVIDIA's driver lists (empty where
    nvidia-smi is missing or fails, or sysfs does not say)."""
    try:
        listing = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    near: dict[int, set[int]] = {}
    for line in listing.splitlines():
        pid, _, bus_id = line.partition(",")
        local = pci_device_dir(bus_id) / "local_cpulist"
        if pid.strip().isdigit() and local.exists():
            near[int(pid)] = set(parse_cpu_list(local.read_text()))
    return near


def user_processes() -> dict[int, str]:
    """pid -> command line of every process with one (kernel threads have none)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile
            continue
        if command:
            processes[int(entry.name)] = command
    return processes


def parent_pid(pid: int) -> int:
    """`pid`'s parent (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name may hold spaces and parentheses: the fields after its closing parenthesis are fixed.
    return int(stat[stat.rindex(")") + 2:].split()[1])


def child_processes(parent: int, title: str) -> list[int]:
    """The pids of `parent`'s children whose command line starts with `title`."""
    return sorted(pid for pid, command in user_processes().items()
                  if command.startswith(title) and parent_pid(pid) == parent)


def pin_threads(pid: int, cpus: list[int], but: int | None = None) -> int:
    """Every thread of `pid` but the one whose id is `but` to `cpus` (threads it starts later take their starter's
    CPUs); how many took it."""
    done = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        if int(task.name) == but:
            continue
        try:
            os.sched_setaffinity(int(task.name), cpus)
            done += 1
        except OSError:  # a thread that ended meanwhile
            continue
    return done


def pin_schedulers(setting: str, lock_dir: Path = DEFAULT_LOCK_DIR, parent_pid: int | None = None) -> list[CpuClaim]:
    """Hold each SGLang scheduler started by this process on CPUs of its own, as `setting` says: "auto" claims
    CPUS_PER_SCHEDULER CPUs each (whole cores) from what no other worker holds; a CPU list ("14,15", "12-15") gives
    every scheduler those; "off" leaves them where the kernel puts them. What cannot be done is logged and left:
    never a reason for the worker not to serve. Returns the claims to hold for the worker's life."""
    if setting == "off":
        return []
    if not hasattr(os, "sched_setaffinity"):
        log.warning("sglang.scheduler_cpus_unsupported", reason="this platform cannot set CPU affinity")
        return []
    schedulers = child_processes(os.getpid() if parent_pid is None else parent_pid, SCHEDULER_TITLE)
    if not schedulers:
        log.warning("sglang.scheduler_cpus_skipped", reason=f"no child process titled {SCHEDULER_TITLE!r}")
        return []
    claims: list[CpuClaim] = []
    # A process namespace of its own (a container) may hide the driver's pids from us: then no core is nearer.
    near_by_pid = gpu_cpus_by_pid() if setting == "auto" else {}
    for pid in schedulers:
        if setting == "auto":
            try:
                claim = claim_cores(CPUS_PER_SCHEDULER, lock_dir, near_cpus=near_by_pid.get(pid))
            except OSError as error:  # a lock directory this user may not write
                log.warning("sglang.scheduler_cpus_skipped", scheduler_pid=pid, lock_dir=str(lock_dir),
                            reason=repr(error))
                continue
            if claim is None:
                log.warning("sglang.scheduler_cpus_skipped", scheduler_pid=pid, lock_dir=str(lock_dir),
                            reason="no free whole cores to spare (too few CPUs, or other workers hold them)")
                continue
            claims.append(claim)
            cpus = claim.cpus
        else:
            cpus = parse_cpu_list(setting)
            if not set(cpus) <= os.sched_getaffinity(0):
                log.warning("sglang.scheduler_cpus_skipped", scheduler_pid=pid, cpus=cpus,
                            reason="CPUs this worker may not use")
                continue
        helpers = hold_main_thread(pid, cpus)
        near = near_by_pid.get(pid)
        log.info("sglang.scheduler_pinned", scheduler_pid=pid, cpus=cpus, helper_threads_moved_off=helpers,
                 near_its_gpu=None if near is None else set(cpus) <= near)  # None: its GPU not known
    return claims


def hold_main_thread(pid: int, cpus: list[int]) -> int:
    """The main thread of `pid` to `cpus`, and every other thread of it to the CPUs it may use but those; how many
    others moved. Why not all of them on `cpus`: SGLang's scheduler wakes ZMQ's I/O thread at each step's send, and a
    woken thread held on the scheduler's own CPUs lands on the scheduler when the sibling CPU is busy, preempting it
    (at 256 streams `Socket.send` took 12-15% of its samples against the server's 4%: docs/performance.md)."""
    try:
        allowed = os.sched_getaffinity(pid)
        os.sched_setaffinity(pid, cpus)  # the thread whose id is the process id: SGLang's scheduling loop
    except OSError:  # the scheduler ended meanwhile
        return 0
    return pin_threads(pid, sorted(allowed - set(cpus)) or cpus, but=pid)
