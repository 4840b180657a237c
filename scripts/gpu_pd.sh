#!/usr/bin/env bash
# Disaggregated serving with SGLang on ONE GPU: prefill and decode engines share it, so they start
# one after the other — SGLang's mem_fraction_static caps the GPU memory in use *as it finds it*,
# so the second engine's fraction must cover the first's too. Run through scripts/gpu_run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-.gpu/smol}
PORT=${PORT:-4333}
export CONVEYOR_NATS_URLS=nats://127.0.0.1:$PORT CONVEYOR_REGISTRY_TTL_S=30
say() { printf '[gpu-pd] %s\n' "$*" >&2; }
wait_for() {  # wait_for STAGE: until the registry lists a ready worker of that stage
    for _ in $(seq 1 300); do
        if python3 -m workers.cli status 2>/dev/null | grep -E "^\S+\s+$1\s" | grep -q " yes "; then return 0; fi
        sleep 1
    done
    say "$1 worker not ready in time"; return 1
}
python3 -m workers.cli server --port "$PORT" --store-dir /tmp/pd-nats --monitor-port 0 &
pids=($!)
stop() {  # stop PID...: SIGTERM, then SIGKILL after 30 s
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$@" 2>/dev/null || return 0; sleep 1; done
    kill -KILL "$@" 2>/dev/null || true
}
stop_all() {  # the workers first, so that they deregister and drain through the server, then the server
    if [ "${#pids[@]}" -gt 1 ]; then stop "${pids[@]:1}"; fi
    stop "${pids[0]}"
}
trap stop_all EXIT
sleep 2
common=(--engine sglang --mode disaggregated --model "$MODEL" --load-format dummy --log-level WARNING)
say "starting the prefill engine (35% of the GPU)"
CONVEYOR_SGLANG_MEM_FRACTION_STATIC=0.35 python3 -m workers.cli worker prefill "${common[@]}" & pids+=($!)
wait_for prefill
say "starting the decode engine (up to 80% of the GPU, the prefill's share included)"
CONVEYOR_SGLANG_MEM_FRACTION_STATIC=0.8 python3 -m workers.cli worker decode "${common[@]}" & pids+=($!)
wait_for decode
python3 -m workers.cli worker processor --engine sglang --model "$MODEL" --log-level WARNING & pids+=($!)
wait_for processor
python3 -m workers.cli status
# The answers also go to $OUT/pd-answers.txt on the device machine: the workers' shutdown logs come after them and can
# push them out of a call's returned tail (fifty-second stop).
answers=${OUT:-/tmp}/pd-answers.txt
for question in "What is the capital of France?" "Name three colours."; do
    python3 -m workers.cli ask "$question" --model "$MODEL" --max-tokens 24 --temperature 0 2>&1 | tee -a "$answers"
done
# The KV-event stream's count: both engines' events reached it (the inline publisher, since the fiftieth stop).
python3 -m workers.cli streams
