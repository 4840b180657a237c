#!/usr/bin/env bash
# On the GPU machine: start and hold what scripts/bench_vs_sglang.py measures, so that a lease's calls go to
# benchmarks (docs/gpu.md, "Several calls on one warm stack"). Each command returns once its part answers.
#
#   bash scripts/gpu_hold.sh server [ARG...]   SGLang's own server on :30000 (128 running requests, page 16); ARGs go
#                                              to launch_server after ours, e.g. --enable-mixed-chunk
#   bash scripts/gpu_hold.sh server2 [ARG...]  a second one on :30001 (log /tmp/sglang-server2.log, 50% of the GPU),
#                                              e.g. with a stack's engine settings as a control beside the first
#   bash scripts/gpu_hold.sh stack a [VAR=V]   a Conveyor stack: gateway :8000, metrics :9101 (decode :9102), 40% of the GPU
#   bash scripts/gpu_hold.sh stack b [VAR=V]   a second one: gateway :8001, metrics :9111 (decode :9112), NATS :4223, 50%
#   bash scripts/gpu_hold.sh stack c [VAR=V]   a third: gateway :8002, metrics :9121 (decode :9122), NATS :4224, 50% (on
#                                              a machine of several GPUs, each stack on a GPU of its own)
#   bash scripts/gpu_hold.sh stop a|b|c        stop that stack and wait until it has exited (to start it again with
#                                              other settings in the same lease: an A/B with the settings swapped)
#   bash scripts/gpu_hold.sh ready server|server2|a|b|c
#                                              wait until that part answers (one started with HOLD_WAIT=0)
#
# HOLD_WAIT=0 returns as soon as the part is started, without waiting for it to answer: on a machine of two GPUs the
# server and a stack load at the same time (a later call runs `ready`). CUDA_VISIBLE_DEVICES=N in front of a command
# puts that part on GPU N: on an nvidia-h100-x2 lease the server on GPU 0 and stack a on GPU 1 run at the same time
# without time-slicing one GPU (docs/gpu.md, fortieth stop).
# VAR=V settings go to the stack's environment, e.g. CONVEYOR_SGLANG_PREFILL_BUDGET_TOKENS=2048; DECODE_ARGS in
# this script's own environment goes to the decode worker's command line, e.g. DECODE_ARGS='--migration-limit 0';
# GATEWAY_WORKERS=N starts N gateway processes on the stack's port (`conveyor gateway --workers N`).
# Every SGLang here sleeps while idle (--sleep-on-idle; a stack: sleep_on_idle in CONVEYOR_SGLANG_EXTRA_SERVER_ARGS,
# which a stack's own VAR=V of that name replaces, pool and log level included): an idle SGLang scheduler otherwise
# spins a core at 100%, so the system not being measured competed with the one that was (docs/performance.md,
# eighteenth stop).
# Every SGLang here also gets the same KV pool, POOL_TOKENS tokens (default 600000; 300000 fits the server and both
# stacks), and logs at info: left to size its own pool, the server started first took 1.27M tokens and a stack beside
# it about a tenth, so only the stack evicted (docs/performance.md, twenty-second stop); at info each engine logs its
# batches, from which scripts/sglang_steps.py reads its own step rate (`gpu_goals.sh wait` does).
# Start the stacks one after the other: SGLang sizes its pool from the memory it finds free. Logs: /tmp/sglang-server.log,
# /tmp/conveyor-<a|b>.log and /tmp/<a|b>/bench-vs-sglang-conveyor/. SGLang is unpacked first, in a call carrying only
# .gpu/sglang-site.tar.xz (`bash scripts/gpu_run.sh true`); the server carries .gpu/sglang-kernels.tar.xz,
# .gpu/sglang-server.tar.xz and .gpu/smol; a stack .gpu/conveyor-deps.tar.xz, .gpu/bin and .gpu/smol (one call each:
# they do not fit one transfer).
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_RUNNING=128
POOL_TOKENS=${POOL_TOKENS:-600000}

wait_for() {  # wait_for WHAT SECONDS PIDFILE COMMAND...: poll until COMMAND succeeds; give up when PIDFILE's process exits
    local what=$1 seconds=$2 pid_file=$3; shift 3
    for _ in $(seq "$seconds"); do
        if "$@" > /dev/null 2>&1; then echo "[gpu-hold] $what ready"; return 0; fi
        # A held process that died will never answer: say so now rather than at the end of the wait.
        if ! kill -0 "$(cat "$pid_file")" 2> /dev/null; then echo "[gpu-hold] $what exited before it was ready" >&2; return 1; fi
        sleep 1
    done
    echo "[gpu-hold] $what not ready after ${seconds} s" >&2
    return 1
}

server_part() {  # server_part server|server2: sets name, port and fraction (of the GPU) of that server
    if [ "$1" = server ]; then name=sglang-server port=30000 fraction=0.35; else name=sglang-server2 port=30001 fraction=0.5; fi
}

wait_for_server() {  # wait_for_server server|server2
    server_part "$1"
    wait_for "$name" 300 "/tmp/$name.pid" curl -sf "http://127.0.0.1:$port/v1/models" \
        || { tail -20 "/tmp/$name.log"; exit 1; }
}

wait_for_stack() {  # wait_for_stack a|b|c
    wait_for "conveyor stack $1" 300 "/tmp/conveyor-$1.pid" grep -q "ready at" "/tmp/conveyor-$1.log" \
        || { tail -20 "/tmp/conveyor-$1.log"; exit 1; }
    grep "ready at" "/tmp/conveyor-$1.log"
}

case "${1:-}" in
    server|server2)
        # The second server is started after the first (and any stack): SGLang checks its fraction against the memory
        # it finds free, as a stack b does.
        part=$1
        server_part "$part"
        shift
        bash scripts/gpu_run.sh true  # unpack first, so the held process does not race the next call's unpacking
        (setsid nohup bash scripts/gpu_run.sh python3 -m sglang.launch_server --model-path .gpu/smol \
            --load-format dummy --attention-backend triton --sampling-backend pytorch --mem-fraction-static "$fraction" \
            --page-size 16 --host 127.0.0.1 --port "$port" --max-running-requests "$MAX_RUNNING" --log-level info \
            --max-total-tokens "$POOL_TOKENS" \
            --sleep-on-idle "$@" \
            > "/tmp/$name.log" 2>&1 < /dev/null & echo $! > "/tmp/$name.pid")
        if [ "${HOLD_WAIT:-1}" = 0 ]; then echo "[gpu-hold] $name started (not waited for)"; exit 0; fi
        wait_for_server "$part"
        ;;
    stack)
        name=${2:?"stack a, b or c"}
        shift 2
        case "$name" in
            a) options=(--conveyor-mem-fraction 0.4 --out /tmp/a) ;;
            b) options=(--conveyor-mem-fraction 0.5 --nats-port 4223 --gateway-port 8001 --metrics-port 9111 --out /tmp/b) ;;
            c) options=(--conveyor-mem-fraction 0.5 --nats-port 4224 --gateway-port 8002 --metrics-port 9121 --out /tmp/c) ;;
            *) echo "[gpu-hold] a stack is named a, b or c" >&2; exit 2 ;;
        esac
        if [ -n "${DECODE_ARGS:-}" ]; then options+=(--decode-args "$DECODE_ARGS"); fi
        if [ -n "${GATEWAY_WORKERS:-}" ]; then options+=(--gateway-workers "$GATEWAY_WORKERS"); fi
        # A stack's calls carry no SGLang (it does not fit beside conveyor-deps): the server's call on this machine
        # unpacked it. On a machine just started, say so now, not after a stack that cannot import it gave up.
        for pack in sglang-site sglang-kernels; do
            if [ ! -f "/tmp/$pack/.unpacked" ] && [ ! -f ".gpu/$pack.tar.xz" ]; then
                echo "[gpu-hold] SGLang ($pack) is not unpacked on this machine (a fresh one?): start the server first" \
                     "in this lease (bash scripts/gpu_hold.sh server), or carry .gpu/$pack.tar.xz" >&2
                exit 3
            fi
        done
        mkdir -p "/tmp/$name"
        engine="{\"sleep_on_idle\": true, \"max_total_tokens\": $POOL_TOKENS, \"log_level\": \"info\"}"
        (env CONVEYOR_SGLANG_EXTRA_SERVER_ARGS="$engine" "$@" setsid nohup bash scripts/gpu_run.sh \
            python3 scripts/bench_vs_sglang.py conveyor --model .gpu/smol --max-running-requests "$MAX_RUNNING" \
            "${options[@]}" > "/tmp/conveyor-$name.log" 2>&1 < /dev/null & echo $! > "/tmp/conveyor-$name.pid")
        if [ "${HOLD_WAIT:-1}" = 0 ]; then echo "[gpu-hold] conveyor stack $name started (not waited for)"; exit 0; fi
        wait_for_stack "$name"
        ;;
    ready)
        case "${2:-}" in
            server|server2) wait_for_server "$2" ;;
            a|b|c) wait_for_stack "$2" ;;
            *) echo "[gpu-hold] ready server|server2|a|b|c" >&2; exit 2 ;;
        esac
        ;;
    stop)
        name=${2:?"stop a, b or c"}
        # The brackets keep the pattern from matching this script's own command line.
        pattern="bench_vs_sglang[.]py conveyor .*--out /tmp/$name( |$)"
        pkill -TERM -f "$pattern" || { echo "[gpu-hold] no stack $name running" >&2; exit 1; }
        for _ in $(seq 120); do pgrep -f "$pattern" > /dev/null || break; sleep 1; done
        if pgrep -f "$pattern" > /dev/null; then echo "[gpu-hold] stack $name still running after 120 s" >&2; exit 1; fi
        mv "/tmp/conveyor-$name.log" "/tmp/conveyor-$name.$(date +%H%M%S).log" 2>/dev/null || true
        echo "[gpu-hold] conveyor stack $name stopped"
        ;;
    *)
        awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"  # this header
        exit 2
        ;;
esac
