"""How each GPU ran over a run: its SM clock, power and load, and whether the driver held its clock back.

Systems on GPUs of their own compare only where the GPUs ran alike. Their clocks and power limits at rest say little
(every H100 so far read 1,980 MHz and 700 W idle): a GPU held back under load by heat, power or the host shows here.
`scripts/gpu_goals.sh` samples every GPU every 2 s while it runs (gpu-clocks.log):

    nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,utilization.gpu,temperature.gpu,\
        clocks_event_reasons.active --format=csv,noheader -lms 2000 > gpu-clocks.log

    python3 scripts/gpu_clocks.py gpu-clocks.log [--busy-percent 10]

Only samples with the GPU at least --busy-percent utilized count (an idle GPU clocks down, as it should). "Held back"
counts samples whose reasons are more than idle (bit 0x1) and application clocks (0x2): power, thermal, the host's
slowdown and the like (nvidia-smi -q -d PERFORMANCE names the bits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# Reasons that say nothing of a GPU under load: idle (0x1), and clocks the application set (0x2).
_HARMLESS_REASONS = 0x1 | 0x2


@dataclass(frozen=True)
class Sample:
    gpu: int
    sm_clock_mhz: float
    power_w: float
    busy_percent: float
    temperature_c: float
    reasons: int


@dataclass(frozen=True)
class GpuSummary:
    gpu: int
    num_samples: int
    sm_clock_p50_mhz: float
    sm_clock_min_mhz: float
    power_p50_w: float
    busy_p50_percent: float
    temperature_max_c: float
    num_held_back: int


def _number(field: str) -> float:
    """'1980 MHz' -> 1980.0; '[N/A]' and the like -> nan."""
    try:
        return float(field.strip().split()[0])
    except (ValueError, IndexError):
        return float("nan")


def parse_line(line: str) -> Sample | None:
    """One nvidia-smi sample line (the query above), or None for anything else (a header, a torn line)."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != 7:
        return None
    try:
        gpu = int(fields[1])
        reasons = int(fields[6], 16)
    except ValueError:
        return None
    return Sample(gpu=gpu, sm_clock_mhz=_number(fields[2]), power_w=_number(fields[3]),
                  busy_percent=_number(fields[4]), temperature_c=_number(fields[5]), reasons=reasons)


def summarize(lines: list[str], busy_percent: float = 10.0) -> list[GpuSummary]:
    """Each GPU's samples under load (utilization at least `busy_percent`), lowest index first."""
    by_gpu: dict[int, list[Sample]] = {}
    for line in lines:
        sample = parse_line(line)
        if sample is not None and sample.busy_percent >= busy_percent:
            by_gpu.setdefault(sample.gpu, []).append(sample)
    return [
        GpuSummary(
            gpu=gpu,
            num_samples=len(samples),
            sm_clock_p50_mhz=statistics.median(s.sm_clock_mhz for s in samples),
            sm_clock_min_mhz=min(s.sm_clock_mhz for s in samples),
            power_p50_w=statistics.median(s.power_w for s in samples),
            busy_p50_percent=statistics.median(s.busy_percent for s in samples),
            temperature_max_c=max(s.temperature_c for s in samples),
            num_held_back=sum(1 for s in samples if s.reasons & ~_HARMLESS_REASONS),
        )
        for gpu, samples in sorted(by_gpu.items())
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="nvidia-smi's samples (gpu-clocks.log)")
    parser.add_argument("--busy-percent", type=float, default=10.0,
                        help="count only samples with the GPU at least this utilized (default 10)")
    args = parser.parse_args()
    rows = summarize(args.log.read_text().splitlines(), args.busy_percent)
    if not rows:
        sys.exit(f"no sample of a GPU at least {args.busy_percent:g}% busy in {args.log}")
    print(f"{'gpu':>3} {'samples':>8} {'SM MHz p50':>11} {'SM MHz min':>11} {'W p50':>7} {'busy % p50':>11} "
          f"{'max °C':>7} {'held back':>10}")
    for row in rows:
        print(f"{row.gpu:>3} {row.num_samples:>8} {row.sm_clock_p50_mhz:>11.0f} {row.sm_clock_min_mhz:>11.0f} "
              f"{row.power_p50_w:>7.0f} {row.busy_p50_percent:>11.0f} {row.temperature_max_c:>7.0f} "
              f"{row.num_held_back:>10}")


if __name__ == "__main__":
    main()
