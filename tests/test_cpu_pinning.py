"""Holding SGLang's scheduler on CPUs of its own (workers/engines/cpu_pinning.py), on this machine's real CPUs and
real child processes: claims between workers, the share left to the rest, and the pinning itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engines.cpu_pinning import (
    SCHEDULER_TITLE,
    claim_cores,
    claim_order,
    parse_cpu_list,
    pci_device_dir,
    physical_cores,
    pin_schedulers,
)
from workers.engines.sglang_engine import SGLangEngineConfig

ALLOWED = set(os.sched_getaffinity(0))


# A scheduler's stand-in: its main thread and one helper beside it (as ZMQ's I/O thread is beside SGLang's loop).
SCHEDULER_PROGRAM = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"


@pytest.fixture
def scheduler() -> Iterator[int]:
    """A child process titled as SGLang titles its scheduler (Python under that name), with a helper thread, free on
    every CPU we have."""
    child = subprocess.Popen([SCHEDULER_TITLE, "-c", SCHEDULER_PROGRAM], executable=sys.executable)
    cmdline = Path(f"/proc/{child.pid}/cmdline")
    tasks = Path(f"/proc/{child.pid}/task")
    deadline_s = time.monotonic() + 10
    # Popen can return before the kernel shows the new program's command line, and the helper starts after that.
    while time.monotonic() < deadline_s and not (
            cmdline.read_bytes().startswith(SCHEDULER_TITLE.encode()) and len(list(tasks.iterdir())) >= 2):
        time.sleep(0.01)
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def helper_threads(pid: int) -> list[int]:
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir() if int(task.name) != pid]


def test_cpu_lists_parse_ranges_and_singles() -> None:
    assert parse_cpu_list("0-2,8") == [0, 1, 2, 8]
    assert parse_cpu_list("14,15") == [14, 15]


def test_workers_sharing_a_lock_dir_claim_different_whole_cores_highest_first(tmp_path: Path) -> None:
    cores = physical_cores(ALLOWED)
    first = claim_cores(1, tmp_path, max_share=1.0)
    second = claim_cores(1, tmp_path, max_share=1.0)
    assert first is not None and first.cpus == cores[-1]
    if len(cores) > 1:
        assert second is not None and second.cpus == cores[-2]
    else:
        assert second is None  # the only core is the first worker's
    first.release()
    again = claim_cores(1, tmp_path, max_share=1.0)
    assert again is not None and again.cpus == cores[-1]  # released: free for the next worker


def test_cores_near_the_scheduler_s_gpu_are_claimed_before_higher_numbered_ones(tmp_path: Path) -> None:
    # Two sockets' worth of cores, the GPU's CPUs the low half: those come first, highest-numbered first among them.
    cores = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert claim_order(cores, near_cpus={0, 1, 4, 5}) == [[1, 5], [0, 4], [3, 7], [2, 6]]
    assert claim_order(cores, near_cpus=None) == [[3, 7], [2, 6], [1, 5], [0, 4]]  # GPU unknown: highest first
    lowest = physical_cores(ALLOWED)[0]
    claim = claim_cores(1, tmp_path, max_share=1.0, near_cpus=set(lowest))
    assert claim is not None and claim.cpus == lowest


def test_a_gpu_s_pci_address_from_nvidia_smi_names_its_sysfs_directory() -> None:
    assert pci_device_dir("00000000:18:00.0") == Path("/sys/bus/pci/devices/0000:18:00.0")
    assert pci_device_dir(" 00000001:AB:00.0\n") == Path("/sys/bus/pci/devices/0001:ab:00.0")


def test_a_claim_that_would_take_more_than_its_share_of_the_cpus_is_refused(tmp_path: Path) -> None:
    assert claim_cores(len(ALLOWED), tmp_path) is None
    # Refused whole: no core of it stays locked.
    assert claim_cores(1, tmp_path, max_share=1.0).cpus == physical_cores(ALLOWED)[-1]


def test_a_cpu_list_holds_the_scheduler_s_loop_there_and_its_helper_threads_off_it(scheduler: int) -> None:
    cpu = max(ALLOWED)
    assert pin_schedulers(str(cpu)) == []  # a given list claims nothing: the operator chose it
    assert os.sched_getaffinity(scheduler) == {cpu}
    helpers = helper_threads(scheduler)
    assert helpers  # the stand-in's helper thread
    for thread in helpers:
        # Off the loop's CPU where there is another to go to; a one-CPU machine has nowhere else.
        assert os.sched_getaffinity(thread) == (ALLOWED - {cpu} or {cpu})


def test_auto_holds_the_scheduler_on_claimed_cores_where_cpus_can_be_spared(scheduler: int, tmp_path: Path) -> None:
    claims = pin_schedulers("auto", lock_dir=tmp_path)
    if len(ALLOWED) >= 8:  # two CPUs are at most a quarter of what this process may use
        assert len(claims) == 1
        assert os.sched_getaffinity(scheduler) == set(claims[0].cpus)
        assert all(os.sched_getaffinity(thread) == ALLOWED - set(claims[0].cpus)
                   for thread in helper_threads(scheduler))
        assert claim_cores(1, tmp_path, max_share=1.0).cpus != claims[0].cpus  # held from other workers
    else:  # too few to spare: left where the kernel puts it
        assert claims == []
        assert os.sched_getaffinity(scheduler) == ALLOWED
    for claim in claims:
        claim.release()


def test_off_or_cpus_not_ours_leave_the_scheduler_free(scheduler: int) -> None:
    assert pin_schedulers("off") == []
    assert os.sched_getaffinity(scheduler) == ALLOWED
    pin_schedulers(str(os.cpu_count() + 64))  # a CPU no one has: logged and left, never raised
    assert os.sched_getaffinity(scheduler) == ALLOWED


def test_a_lock_dir_that_cannot_be_made_leaves_the_scheduler_free(scheduler: int, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert pin_schedulers("auto", lock_dir=blocker / "locks") == []  # logged, never raised
    assert os.sched_getaffinity(scheduler) == ALLOWED


def test_only_this_process_s_own_schedulers_are_pinned(scheduler: int) -> None:
    pin_schedulers(str(max(ALLOWED)), parent_pid=os.getppid())  # our parent's children: not this scheduler
    assert os.sched_getaffinity(scheduler) == ALLOWED


def test_the_engine_setting_is_auto_off_or_a_cpu_list() -> None:
    assert SGLangEngineConfig(model_path="m").scheduler_cpus == "auto"
    assert SGLangEngineConfig(model_path="m", scheduler_cpus="12-15").scheduler_cpus == "12-15"
    with pytest.raises(ValueError, match="CPU list"):
        SGLangEngineConfig(model_path="m", scheduler_cpus="fast")
