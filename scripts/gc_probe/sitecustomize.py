"""Times every garbage collection of each Python process that starts with this folder on its path and
CONVEYOR_GC_PROBE_DIR set: a diagnostic for the GPU runs, read by scripts/gc_report.py.

Python imports `sitecustomize` at start-up from its path, so every process of a system (SGLang's scheduler and
detokenizer, which multiprocessing starts afresh, included) counts its own collections by generation: how many, the
seconds they took, the longest. Each process appends its running totals to DIR/gc-PID.jsonl at most every
CONVEYOR_GC_PROBE_EVERY_S seconds (default 5) and at exit, with its title as it reads then (SGLang renames its
processes `sglang::scheduler` and the like), its GPU (CUDA_VISIBLE_DEVICES) and its parent's command line, which
tell the systems on one machine apart.

    CONVEYOR_GC_PROBE_DIR=/tmp/gc PYTHONPATH=scripts/gc_probe python3 -m sglang.launch_server ...

Where the variable is unset this module does nothing. A collection costs the probe two clock reads; a line is written
from the callback that ends a collection, after the collection has been timed.
"""

import os

_DIR = os.environ.get("CONVEYOR_GC_PROBE_DIR")

if _DIR:
    import atexit
    import gc
    import json
    import time

    _EVERY_S = float(os.environ.get("CONVEYOR_GC_PROBE_EVERY_S", "5"))
    _counts = [0, 0, 0]
    _seconds = [0.0, 0.0, 0.0]
    _longest_s = [0.0, 0.0, 0.0]
    _started = [0.0]
    _written_at = [time.monotonic()]

    def _read(path: str) -> str:
        try:
            with open(path, "rb") as file:
                return file.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
        except OSError:
            return ""

    def _write() -> None:
        now = time.time()
        local = time.localtime(now)
        line = {
            "t": round(now, 3),
            # Seconds since local midnight: what SGLang's and bench_aiperf.py's stamps read.
            "clock_s": local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec,
            "pid": os.getpid(),
            "title": _read("/proc/self/cmdline"),
            "parent": _read(f"/proc/{os.getppid()}/cmdline"),
            "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "counts": _counts,
            "seconds": [round(value, 6) for value in _seconds],
            "longest_s": [round(value, 6) for value in _longest_s],
        }
        try:
            os.makedirs(_DIR, exist_ok=True)
            with open(os.path.join(_DIR, f"gc-{os.getpid()}.jsonl"), "a") as file:
                file.write(json.dumps(line) + "\n")
        except OSError:
            pass  # a diagnostic never stops the process it watches

    def _on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        generation = info.get("generation", 2)
        took_s = time.perf_counter() - _started[0]
        _counts[generation] += 1
        _seconds[generation] += took_s
        _longest_s[generation] = max(_longest_s[generation], took_s)
        if time.monotonic() - _written_at[0] >= _EVERY_S:
            _written_at[0] = time.monotonic()
            _write()

    gc.callbacks.append(_on_collection)
    atexit.register(_write)
