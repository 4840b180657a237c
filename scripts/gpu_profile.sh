#!/usr/bin/env bash
# On the GPU machine, with the server and stack a held (scripts/gpu_hold.sh): put aiperf's load on each target in turn
# and profile its processes meanwhile (scripts/profile_processes.py: py-spy, CPU per process, event-loop lag).
#
#   bash scripts/gpu_profile.sh OUT_DIR [CONCURRENCY] [TARGET...]     TARGET: server | conveyor (default: both)
#
# The server's profile is its main process (HTTP, tokenizer manager); Conveyor's are the decode worker (SGLang's
# tokenizer manager and the reply path), the gateway (the last started, with GATEWAY_WORKERS) and the processor. Each
# side also has its SGLang scheduler and detokenizer profiled: with a small model the scheduler's CPU caps both. Each
# target gets one aiperf warm-up run first (the first run on a fresh stack is slower; WARMUP=0 skips it). The warm-up
# sends WARMUP_REQUESTS_PER_STREAM requests per stream (default 2), the profiled run PROFILE_REQUESTS_PER_STREAM (8):
# 16 for the warm-up fills SGLang's cache at 64 streams, so that the profiled run evicts as a long steady load does
# (where SGLang records the most KV events: docs/performance.md, twenty-first and twenty-second stops). Per target:
# OUT_DIR/prof-TARGET.json, TARGET-profiles.tgz (py-spy's collapsed stacks, one file per process) and
# aiperf-TARGET.log: six files in all, under what a device call's $OUT brings back.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?"usage: gpu_profile.sh OUT_DIR [CONCURRENCY] [TARGET...]"}
concurrency=${2:-64}
shift $(( $# < 2 ? $# : 2 ))
if [ $# -gt 0 ]; then targets=("$@"); else targets=(server conveyor); fi
mkdir -p "$out"

aiperf() {  # aiperf NAME URL REQUESTS_PER_STREAM
    bash scripts/gpu_run.sh python3 scripts/bench_aiperf.py --tokenizer .gpu/smol "$1=$2" --concurrency "$concurrency" \
        --rounds 1 --warmup-runs 0 --requests-per-stream "$3" --out "/tmp/aiperf-$1"
}

for target in "${targets[@]}"; do
    case "$target" in
        server)
            url=http://127.0.0.1:30000
            main=$(pgrep -f '^python3 -m [s]glang.launch_server' | head -1) || true
            [ -n "$main" ] || { echo "[gpu-profile] no server running: bash scripts/gpu_hold.sh server" >&2; exit 1; }
            processes=("server=$main" "scheduler=$(pgrep -P "$main" -f scheduler | head -1)"
                       "detokenizer=$(pgrep -P "$main" -f detokenizer | head -1)")
            metrics=()
            ;;
        conveyor)
            url=http://127.0.0.1:8000
            decode=$(pgrep -f '[w]orkers.cli worker decode' | head -1) || true
            [ -n "$decode" ] || { echo "[gpu-profile] no stack running: bash scripts/gpu_hold.sh stack a" >&2; exit 1; }
            processes=("decode=$decode" "scheduler=$(pgrep -P "$decode" -f scheduler | head -1)"
                       "detokenizer=$(pgrep -P "$decode" -f detokenizer | head -1)"
                       "gateway=$(pgrep -f '[w]orkers.cli gateway --port 8000' | tail -1)"
                       "processor=$(pgrep -f '[w]orkers.cli worker processor' | head -1)")
            metrics=(--metrics decode=http://127.0.0.1:9102/metrics gateway=$url/metrics
                     processor=http://127.0.0.1:9101/metrics)
            ;;
        *) echo "[gpu-profile] a target is server or conveyor, not $target" >&2; exit 2 ;;
    esac
    if [ "${WARMUP:-1}" = 1 ]; then
        echo "[gpu-profile] $target: warm-up" >&2
        aiperf "$target-warmup" "$url" "${WARMUP_REQUESTS_PER_STREAM:-2}" > "/tmp/aiperf-$target-warmup.log" 2>&1
    fi
    echo "[gpu-profile] $target: loaded run, profiled (${processes[*]})" >&2
    aiperf "$target" "$url" "${PROFILE_REQUESTS_PER_STREAM:-8}" > "$out/aiperf-$target.log" 2>&1 &
    loader=$!
    # The window opens when the scheduler is busy: it sleeps while idle and runs a whole core under any load, where
    # the main processes pass no threshold at one stream (a 1-stream run waited 180 s for the server's and gave up).
    bash scripts/gpu_run.sh python3 scripts/profile_processes.py "${processes[@]}" --when-busy scheduler \
        --busy-percent 50 --duration-s 10 \
        "${metrics[@]}" --out "/tmp/profile-$target" > "$out/prof-$target.json" 2> "/tmp/profile-$target.err" || true
    wait "$loader" || echo "[gpu-profile] $target: aiperf failed (see $out/aiperf-$target.log)" >&2
    profiles=$(cd "/tmp/profile-$target" 2> /dev/null && ls profile-*.txt 2> /dev/null) || true
    if [ -n "$profiles" ]; then
        tar -C "/tmp/profile-$target" -czf "$out/$target-profiles.tgz" $profiles
    else  # the next target still runs
        echo "[gpu-profile] $target: no profiles ($(tail -1 "/tmp/profile-$target.err" 2> /dev/null))" >&2
    fi
done
