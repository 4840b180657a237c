"""Scale-out of the bus: the mock engine with 1, 2, 4, 8 decode replicas (and half as many processors), each
replica given the same number of streams, all load published straight to NATS by client processes.

For each replica count it prints output tokens/s in all and per replica, the scale-out efficiency (tok/s at N ÷
N × tok/s at 1), TTFT p50 / p99, the CPU of the nats-server, of each decode worker and processor (one core = 100%)
and the cores busy on the whole machine (the load's client processes included): a replica count that fills the
machine shows there, apart from the bus. Then, at the largest count, the same load read by a single client process,
so the rate one process can take in is measured apart from the bus.

    .venv/bin/python scripts/bench_scale.py                       # 1 2 4 8 replicas, 64 streams each
    .venv/bin/python scripts/bench_scale.py --replicas 1 2 --streams-per-replica 16 --output-len 64

Each worker and client is its own process, as deployed; one nats-server per replica count, on a fresh store.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_vs_sglang as vs  # noqa: E402  — its NATS client processes and process handling
from bus.server import free_port  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far (Linux /proc): `conveyor server` is a
    Python parent of the nats-server binary."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return own + sum(cpu_seconds(child) for child in children)


def start_stack(args: argparse.Namespace, replicas: int, logs: Path) -> vs.Servers:
    servers = vs.Servers(args, logs)
    servers.nats_url = f"nats://127.0.0.1:{args.nats_port}"
    store = logs / "nats-store"
    store.mkdir(parents=True, exist_ok=True)
    # A monitor port of its own: the default (8222) belongs to any stack already running on the machine, and
    # nats-server exits when it cannot bind it (what stopped this benchmark on the GPU machine, 2026-11-25).
    servers.spawn("nats", [sys.executable, "-m", "workers.cli", "server", "--port", str(args.nats_port),
                           "--monitor-port", str(free_port()), "--store-dir", str(store)])
    env = {"CONVEYOR_NATS_URLS": servers.nats_url, "CONVEYOR_NAMESPACE": servers.namespace,
           "CONVEYOR_MOCK_INTER_TOKEN_S": str(args.inter_token_ms / 1000),
           "CONVEYOR_MOCK_LOCKSTEP": "true" if args.lockstep else "false"}
    worker = [sys.executable, "-m", "workers.cli", "worker", "--engine", "mock", "--model", "mock", "--log-level",
              "WARNING", "--max-concurrency", str(args.worker_concurrency or args.streams_per_replica * 2)]
    for index in range(max(1, replicas // 2)):
        servers.spawn(f"processor-{index}", worker[:4] + ["processor"] + worker[4:], env)
    for index in range(replicas):
        servers.spawn(f"decode-{index}", worker[:4] + ["decode"] + worker[4:] + shlex.split(args.decode_args), env)
    try:
        vs.asyncio.run(wait_ready(servers, replicas + max(1, replicas // 2), args.start_timeout_s))
    except BaseException:
        # Say why from the processes' own logs, and leave nothing running behind a failed start.
        for log in sorted(logs.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-8:]
            vs.say(f"{log.name} ends:\n    " + "\n    ".join(lines or ["(empty)"]))
        servers.stop()
        raise
    return servers


async def wait_ready(servers: vs.Servers, num_workers: int, timeout_s: float) -> None:
    from bus.client import open_client
    from bus.settings import BusSettings, NatsSettings

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with open_client(NatsSettings(urls=[servers.nats_url]), BusSettings(namespace=servers.namespace),
                                   "bench-scale") as client:
                while time.monotonic() < deadline:
                    if len([card for card in await client.live_workers() if card.ready]) >= num_workers:
                        return
                    await vs.asyncio.sleep(0.5)
        except Exception:  # the server is still starting
            await vs.asyncio.sleep(0.5)
    raise TimeoutError(f"{num_workers} workers not ready within {timeout_s:.0f} s")


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy (Linux /proc/stat: all but idle and iowait)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(servers: vs.Servers) -> dict[str, float]:
    """CPU seconds so far of each process the stack started (`nats`, `decode-0`, `processor-0`, ...)."""
    return {name: cpu_seconds(process.pid) for name, process in servers.processes.items()}


def measure(args: argparse.Namespace, servers: vs.Servers, concurrency: int, clients: int) -> dict[str, Any]:
    """One load, with the CPU each role's processes used meanwhile, as the mean per process (one core = 100%), and
    the machine's busy cores: where the cores went, to tell a bus that stops scaling from a machine that is full."""
    args.nats_clients = clients
    before_s, busy_before_s, wall_before = process_cpu_s(servers), machine_busy_s(), time.monotonic()
    row = vs.bench_nats(args, servers.nats_url, servers.namespace, concurrency, seed=concurrency)
    wall_s = time.monotonic() - wall_before
    by_role: dict[str, list[float]] = {}
    for name, spent_s in process_cpu_s(servers).items():
        by_role.setdefault(name.split("-")[0], []).append(100 * (spent_s - before_s[name]) / wall_s)
    for role, percents in by_role.items():
        row[f"{role}_cpu_percent"] = sum(percents) / len(percents)
    row["machine_cpu_percent"] = 100 * (machine_busy_s() - busy_before_s) / wall_s
    return row


def run(args: argparse.Namespace) -> None:
    rows: dict[int, list[dict[str, Any]]] = {}
    single: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for replicas in args.replicas:
            logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-scale-{uuid.uuid4().hex[:6]}"
            logs.mkdir(parents=True)
            servers = start_stack(args, replicas, logs)
            try:
                concurrency = args.streams_per_replica * replicas
                row = measure(args, servers, concurrency, clients=max(2, replicas))
                rows.setdefault(replicas, []).append(row)
                vs.say(f"round {round_index + 1}, {replicas} replicas, {concurrency} streams: "
                       f"{row['output_throughput']:.0f} tok/s, nats-server {row['nats_cpu_percent']:.0f}% CPU")
                if replicas == max(args.replicas):
                    single.append(measure(args, servers, concurrency, clients=1))
            except BaseException:
                vs.say(f"the processes' logs are kept in {logs}")
                raise
            finally:
                servers.stop()
            shutil.rmtree(logs, ignore_errors=True)  # a round that went well leaves nothing behind
    base = vs.median_row(rows[min(args.replicas)])["output_throughput"] / min(args.replicas)
    print(f"\nmock engine ({args.inter_token_ms:g} ms per token), {args.streams_per_replica} streams per replica, "
          f"prompts {int(args.input_len * args.range_ratio)}–{args.input_len}, outputs "
          f"{int(args.output_len * args.range_ratio)}–{args.output_len} tokens, {os.cpu_count()} cores, "
          f"medians of {args.rounds} rounds")
    print(f"{'replicas':>8} {'tok/s':>9} {'per replica':>12} {'efficiency':>11} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'nats CPU':>9} {'decode CPU':>11} {'proc CPU':>9} {'machine':>8}")
    for replicas in args.replicas:
        row = vs.median_row(rows[replicas])
        tokens = row["output_throughput"]
        print(f"{replicas:>8} {tokens:>9.0f} {tokens / replicas:>12.0f} {tokens / (replicas * base):>10.2f}× "
              f"{row['median_ttft_ms']:>7.1f}ms {row['p99_ttft_ms']:>7.1f}ms {row['nats_cpu_percent']:>8.0f}% "
              f"{row['decode_cpu_percent']:>10.0f}% {row['processor_cpu_percent']:>8.0f}% "
              f"{row['machine_cpu_percent'] / 100:>7.1f}c")
    print("decode / proc CPU: each replica's mean (one core = 100%); machine: cores busy in all, clients included")
    for replicas in args.replicas:
        row = vs.median_row(rows[replicas])
        per_token_us = {role: 1e4 * row[f"{role}_cpu_percent"] * count / row["output_throughput"]
                        for role, count in (("nats", 1), ("decode", replicas), ("processor", max(1, replicas // 2)))}
        print(f"CPU per output token at {replicas} replicas: " +
              ", ".join(f"{role} {us:.0f} µs" for role, us in per_token_us.items()))
    one = vs.median_row(single)
    many = vs.median_row(rows[max(args.replicas)])
    print(f"one client process reading all {args.streams_per_replica * max(args.replicas)} streams: "
          f"{one['output_throughput']:.0f} tok/s ({one['output_throughput'] / many['output_throughput']:.2f}× of "
          f"{max(2, max(args.replicas))} client processes), TTFT p99 {one['p99_ttft_ms']:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streams-per-replica", type=int, default=64)
    parser.add_argument("--inter-token-ms", type=float, default=10.0, help="The mock engine's time per token.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=512, help="Longest prompt, in tokens.")
    parser.add_argument("--output-len", type=int, default=256, help="Most new tokens per request.")
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument("--prompts-per-stream", type=int, default=2, help="Requests per run = streams × this.")
    parser.add_argument("--worker-concurrency", type=int, default=0,
                        help="Tasks each worker holds at once (0: twice the streams per replica). The mock engine runs "
                             "64 at most; a worker holding more keeps the rest waiting while other replicas have room.")
    parser.add_argument("--lockstep", action="store_true",
                        help="Step each engine's streams on one clock, as SGLang steps its batch (default: a timer each)")
    parser.add_argument("--decode-args", default="",
                        help="More options for each decode worker, e.g. '--migration-limit 0' (no reply journal)")
    parser.add_argument("--nats-port", type=int, default=4333)
    parser.add_argument("--start-timeout-s", type=float, default=120)
    parser.add_argument("--run-timeout-s", type=float, default=600)
    args = parser.parse_args()
    # What the shared client code reads.
    args.model, args.min_prompts = "mock", 1
    run(args)


if __name__ == "__main__":
    main()
