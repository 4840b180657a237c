#!/usr/bin/env bash
# On the GPU machine, with the server and stack a held (scripts/gpu_hold.sh): every row of issue 11's goal table in
# one run, in the background, so that it outlives the device call that starts it (a call lasts at most 600 s).
#
#   bash scripts/gpu_goals.sh start [ROUNDS]   start the run (default 3 rounds per level); returns at once
#   bash scripts/gpu_goals.sh wait SECONDS OUT wait until the run ends or SECONDS pass; copy what it has to OUT,
#                                              packed as OUT.tar (a device call returns at most 8 files), the larger
#                                              logs xz-compressed, the runner's and the CPU sampler's raw logs left out
#
# Steps, in order of what the goals need most (each step's output: /tmp/goals/<step>.log):
#   aiperf    scripts/bench_aiperf.py: the server and stack a at each of GOALS_LEVELS streams (default 64 256 16 1),
#             one warm-up run each
#   ttft      scripts/bench_ttft.py: the first token at one stream, paired prompt by prompt
#   streams   scripts/bench_ttft.py with outputs of 128–512 tokens: token rate and inter-token latency at one
#             stream, paired prompt by prompt
#   onestream (not in the default list) the first token at one stream three ways, paired: short requests back
#             to back, after 1 s of idle each, whole streams of 128–512 tokens (docs/performance.md, 25th stop)
#   onechat   (not in the default list) the same through the chat route, aiperf's (bench_ttft.py --chat): short
#             requests back to back, then whole streams (docs/performance.md, 33rd stop)
#   spread    (not in the default list) scripts/bench_gateway_spread.py: one stream's first token through a gateway
#             of one process and of two, over one connection and over four in turn (CPU only; aiperf itself
#             keeps one connection at one stream: docs/performance.md, 34th stop)
#   scale     scripts/bench_scale.py: the mock engine with 1, 2, 4 and 8 decode replicas, 4 requests a stream (CPU only)
#   fanin     scripts/bench_fanin.py: tokens/s into one receiving process (CPU only)
#   serving   scripts/bench_vs_sglang.py: bench_serving's bursts at 64 streams, with the server's own control
# GOALS_STEPS picks and orders them (default: all, in the order above). GOALS_ALSO="NAME=URL ..." adds targets to
# the aiperf, ttft, streams, onestream and onechat steps, measured in the same rounds
# (GOALS_ALSO=b=http://127.0.0.1:8001).
# GOALS_GROUPS="servers=sglang,server2 stacks=conveyor,b" reads the aiperf step's goals off each group's mean
# (bench_aiperf.py --group): each system twice, a GPU each, so that one instance's vCPU weighs half as much.
# GOALS_TOGETHER=1 runs the aiperf step's systems at the same time in each round (bench_aiperf.py --together);
# GOALS_TOGETHER_FROM=N only the levels of at least N streams (the rest one system after another).
# GOALS_REQUESTS_PER_STREAM (default 4) lengthens each aiperf run: at 4, a 64-stream run is 7-9 s under load in 40 s;
# GOALS_REQUESTS_AT="16=24 128=12" gives those levels their own requests per stream (a 16-stream run at 6 is ~6 s
# under load). GOALS_ROUNDS_AT="16=5 64=5" gives those levels their own number of rounds. GOALS_MIN_REQUESTS
# (bench_aiperf.py's default: 16) is the fewest requests of any run (one stream's, in practice).
# A step that fails is logged and the next one runs. While the run lasts, top's busiest processes are logged every
# 2 s (top.log), so a slow round can be read against what else ran, and how long each SGLang scheduler waited for a
# CPU (sched.log; `wait` summarizes it in sched-wait.txt), and each CPU's time stolen by the host over the run
# (cpu-steal.txt), and each GPU's SM clock, power, load and clock-limiting reasons every 2 s (gpu-clocks.log; `wait`
# summarizes it in gpu-clocks.txt: systems on GPUs of their own compare only where the GPUs ran alike).
# GOALS_PROFILE_AT=16#2 records every SGLang scheduler with py-spy for 15 s once that level's second round is under
# load (profile.json: each one's busiest functions; `wait` brings the raw stacks as profiles.tgz). Processes started
# with the GC probe (CONVEYOR_GC_PROBE_DIR=/tmp/gc, scripts/gc_probe on PYTHONPATH) have their collections read back
# level by level (gc.txt, scripts/gc_report.py).
# /tmp/goals/done marks the end.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${GOALS_DIR:-/tmp/goals}  # where the run writes (GOALS_DIR: elsewhere, e.g. for a test of `wait`)
server=http://127.0.0.1:30000
stack=http://127.0.0.1:8000

step() {  # step NAME COMMAND...: run one step under gpu_run.sh, its output to its log, its status noted
    local name=$1; shift
    echo "[gpu-goals $(date +%T)] $name: $*" >> "$dir/progress.log"
    if bash scripts/gpu_run.sh "$@" > "$dir/$name.log" 2>&1; then status=ok; else status="failed ($?)"; fi
    echo "[gpu-goals $(date +%T)] $name: $status" >> "$dir/progress.log"
}

run_step() {  # run_step NAME ROUNDS
    local also_named=(${GOALS_ALSO:-}) also_urls=()
    for target in "${also_named[@]}"; do also_urls+=("${target#*=}"); done
    case "$1" in
        aiperf) step aiperf python3 scripts/bench_aiperf.py --tokenizer .gpu/smol "sglang=$server" "conveyor=$stack" \
                    "${also_named[@]}" \
                    --concurrency ${GOALS_LEVELS:-64 256 16 1} --rounds "$2" --workers-max 4 --out "$dir/aiperf" \
                    --requests-per-stream "${GOALS_REQUESTS_PER_STREAM:-4}" \
                    $(for level in ${GOALS_REQUESTS_AT:-}; do echo --requests-per-stream-at "$level"; done) \
                    $(for level in ${GOALS_ROUNDS_AT:-}; do echo --rounds-at "$level"; done) \
                    $(for group in ${GOALS_GROUPS:-}; do echo --group "$group"; done) \
                    ${GOALS_MIN_REQUESTS:+--min-requests "$GOALS_MIN_REQUESTS"} ${GOALS_TOGETHER:+--together} \
                    ${GOALS_TOGETHER_FROM:+--together-from "$GOALS_TOGETHER_FROM"} ;;
        ttft) step ttft python3 scripts/bench_ttft.py --model .gpu/smol "$server" "$stack" "${also_urls[@]}" ;;
        streams) step streams python3 scripts/bench_ttft.py --model .gpu/smol --requests 60 --min-tokens 128 \
                     --max-tokens 512 --progress-every 20 "$server" "$stack" "${also_urls[@]}" ;;
        onestream) step onestream-short python3 scripts/bench_ttft.py --model .gpu/smol --requests 150 \
                       "$server" "$stack" "${also_urls[@]}"
                   step onestream-idle python3 scripts/bench_ttft.py --model .gpu/smol --requests 45 --idle-s 1 \
                       "$server" "$stack" "${also_urls[@]}"
                   step onestream-whole python3 scripts/bench_ttft.py --model .gpu/smol --requests 30 --min-tokens 128 \
                       --max-tokens 512 --progress-every 30 "$server" "$stack" "${also_urls[@]}" ;;
        onechat) step onechat-short python3 scripts/bench_ttft.py --model .gpu/smol --chat --requests 150 \
                     "$server" "$stack" "${also_urls[@]}"
                 step onechat-whole python3 scripts/bench_ttft.py --model .gpu/smol --chat --requests 30 \
                     --min-tokens 128 --max-tokens 512 --progress-every 30 "$server" "$stack" "${also_urls[@]}" ;;
        spread) step spread python3 scripts/bench_gateway_spread.py --requests 150 ;;
        # 4 requests a stream: at 2 a run lasts ~8 s, and the last stream's stragglers weigh on the rate more the
        # more streams there are (thirty-fifth stop: 0.92 / 0.88 / 0.86 at 2, 0.98 / 0.94 / 0.94 at 4, same lease).
        scale) step scale python3 scripts/bench_scale.py --rounds 1 --prompts-per-stream 4 ;;
        fanin) step fanin python3 scripts/bench_fanin.py --senders 8 --streams 1024 --tokens-per-frame 1 8 --rounds 2 ;;
        serving) step serving python3 scripts/bench_vs_sglang.py --model .gpu/smol --sglang-url "$server" \
                     --conveyor-url "$stack" --control --concurrency 64 --rounds 6 --min-prompts 16 \
                     --max-running-requests 128 --nats-clients 0 --out "$dir/serving" ;;
        *) echo "[gpu-goals $(date +%T)] $1: no such step" >> "$dir/progress.log" ;;
    esac
}

profile_at() {  # profile_at LABEL: py-spy on every SGLang scheduler for 15 s, once LABEL's second round is loaded
    local label=$1 schedulers=()
    until grep -q "concurrency $label, round 2/" "$dir/aiperf.log" 2>/dev/null; do
        [ -f "$dir/done" ] && return 0
        sleep 2
    done
    # Named by GPU: on a machine of several, each system has a GPU of its own. nvidia-smi tells which (SGLang's
    # process title overwrites the scheduler's /proc/PID/environ, CUDA_VISIBLE_DEVICES with it).
    local gpu_of apps; gpu_of=$(nvidia-smi --query-gpu=uuid,index --format=csv,noheader 2>/dev/null | tr -d ' ')
    apps=$(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader 2>/dev/null | tr -d ' ')
    for pid in $(pgrep -f '^sglang::scheduler'); do
        uuid=$(echo "$apps" | awk -F, -v pid="$pid" '$1 == pid { print $2 }')
        gpu=$(echo "$gpu_of" | awk -F, -v uuid="$uuid" '$1 == uuid { print $2 }')
        schedulers+=("scheduler-gpu${gpu:-x}-$pid=$pid")
    done
    echo "[gpu-goals $(date +%T)] profiling at $label: ${schedulers[*]}" >> "$dir/progress.log"
    bash scripts/gpu_run.sh python3 scripts/profile_processes.py "${schedulers[@]}" --busy-percent 50 \
        --duration-s 15 --top 25 --out "$dir/profile" > "$dir/profile.json" 2> "$dir/profile.err" || true
}

run_all() {
    local rounds=$1
    # Frames after the first show each process's CPU over the last 2 s (the first: since it started).
    # Of each frame: the time, the CPU summary and the 16 busiest processes.
    local keep='/^top -/ { n = 0 } { n++; if (n == 1 || n == 3 || (n >= 7 && n <= 22)) print; fflush() }'
    top -b -c -d 2 -w 200 | awk "$keep" > "$dir/top.log" 2>&1 &
    local monitor=$!
    # Which processes hold a context on the GPU (a context that launches work time-slices the GPU with the engine's):
    # each with its GPU and command line, after the GPUs themselves (systems on GPUs of their own compare only where
    # the GPUs are alike: their clocks and power limits).
    { nvidia-smi --query-gpu=index,uuid,name,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv \
          2>/dev/null
      nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader 2>/dev/null \
          | while IFS=, read -r pid gpu memory; do
              echo "$pid,$gpu,$memory, $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-150)"
          done
      # Which CPUs each GPU is near, the CPUs' cores and nodes, and where each scheduler may run (a held one on
      # two CPUs: is it near its GPU, and on a core of its own? docs/performance.md, forty-first stop).
      nvidia-smi topo -m 2>/dev/null
      lscpu -e=CPU,NODE,SOCKET,CORE 2>/dev/null
      for pid in $(pgrep -f '^sglang::scheduler'); do
          echo "scheduler $pid may run on CPUs $(taskset -cp "$pid" 2>/dev/null | sed 's/.*: //')"
      done
    } > "$dir/gpu-apps.log" || true
    # How long each SGLang scheduler waited for a CPU while it had work (scripts/sched_wait.py).
    bash scripts/gpu_run.sh python3 scripts/sched_wait.py --out "$dir/sched.log" > "$dir/sched-wait.err" 2>&1 &
    local sampler=$!
    cat /proc/stat > "$dir/proc-stat-start"  # each CPU's busy, idle and stolen time over the run (cpu-steal.txt)
    # Each GPU under load (scripts/gpu_clocks.py): drivers before 535 name the limiting reasons "throttle" reasons.
    local reasons=clocks_event_reasons.active
    nvidia-smi --query-gpu="$reasons" --format=csv,noheader > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
    nvidia-smi --query-gpu="timestamp,index,clocks.sm,power.draw,utilization.gpu,temperature.gpu,$reasons" \
        --format=csv,noheader -lms 2000 > "$dir/gpu-clocks.log" 2>&1 &
    local clocks=$!
    if [ -n "${GOALS_PROFILE_AT:-}" ]; then profile_at "$GOALS_PROFILE_AT" & fi
    for name in ${GOALS_STEPS:-aiperf ttft streams scale fanin serving}; do run_step "$name" "$rounds"; done
    kill "$monitor" 2>/dev/null || true
    kill "$clocks" 2>/dev/null || true
    kill "$sampler" 2>/dev/null || true
    cat /proc/stat > "$dir/proc-stat-end"
    touch "$dir/done"
}

case "${1:-}" in
    start)
        rm -rf "$dir" && mkdir -p "$dir"
        # Written here, not by the run: a `wait` right after `start` must find the run it waits for.
        echo "[gpu-goals $(date +%T)] started: ${GOALS_STEPS:-all steps}" > "$dir/progress.log"
        # SGLang stamps its lines with the local time: `wait` keeps the batch lines of this run only.
        date '+%Y-%m-%d %H:%M:%S' > "$dir/started-at"
        # Systems measured at the same time compare bucket by bucket: `wait` then adds the engines' paired rates.
        if [ -n "${GOALS_TOGETHER:-}${GOALS_TOGETHER_FROM:-}" ]; then touch "$dir/together"; fi
        # GOALS_* go along in the environment.
        (setsid nohup bash "$0" run "${2:-3}" > "$dir/run.log" 2>&1 < /dev/null &)
        echo "[gpu-goals] started; progress in $dir/progress.log"
        ;;
    run)
        run_all "$2"
        ;;
    wait)
        seconds=${2:?"wait SECONDS OUT"}; out=${3:?"wait SECONDS OUT"}
        if [ ! -f "$dir/progress.log" ]; then
            # A machine that went back between calls comes back bare: nothing to wait for (docs/gpu.md).
            echo "[gpu-goals] no run on this machine (a fresh one?): start it with gpu_goals.sh start" >&2
            exit 3
        fi
        for _ in $(seq "$seconds"); do
            [ -f "$dir/done" ] && break
            # Asleep first: a run started a moment ago may not have a process yet.
            sleep 1
            # The runner gone without its end mark (killed, out of memory): waiting longer brings nothing.
            [ -f "$dir/done" ] || pgrep -f "gpu_goals[.]sh run" > /dev/null \
                || { echo "[gpu-goals] the run is gone without finishing" >&2; break; }
        done
        mkdir -p "$out"
        cp "$dir"/*.log "$out"/ 2>/dev/null || true
        cp "$dir/aiperf/results.json" "$out/aiperf-results.json" 2>/dev/null || true
        # The rows each system meets against each other one: with a twin held (server2, stack b), the method's floor.
        # The standard library's python3 runs it, as the reports below: the GPU machine's has no other package.
        [ -f "$out/aiperf-results.json" ] \
            && python3 scripts/goals_noise.py "$out/aiperf-results.json" > "$out/goals-noise.txt" 2>&1 || true
        # aiperf's own log of each warm-up run: where its start-up went (thirty-ninth stop: two tokenizer loads).
        for warmup in "$dir"/aiperf/warmup/*/; do
            [ -f "$warmup/aiperf.log" ] && cp "$warmup/aiperf.log" "$out/warmup-$(basename "$warmup")-aiperf.log"
        done
        # SGLang's batch lines, where an engine logs at info (every engine gpu_hold.sh starts does): each engine's
        # steps, round by round.
        since=$(cat "$dir/started-at" 2>/dev/null || echo 0)
        this_run() {  # this_run FILE...: the batch lines stamped at or after this run's start
            grep -h 'Decode batch\|Prefill batch' "$@" 2>/dev/null | awk -v since="$since" 'substr($0, 2, 19) >= since'
        }
        this_run /tmp/sglang-server.log > "$out/server-batches.log" || true
        this_run /tmp/a/bench-vs-sglang-conveyor/*.log > "$out/conveyor-batches.log" || true
        engines=(server="$out/server-batches.log" conveyor="$out/conveyor-batches.log")
        for other in b c; do  # stacks b and c, when held (GOALS_ALSO="b=... c=...")
            [ -d "/tmp/$other/bench-vs-sglang-conveyor" ] || continue
            this_run /tmp/$other/bench-vs-sglang-conveyor/*.log > "$out/$other-batches.log" || true
            [ -s "$out/$other-batches.log" ] && engines+=("$other=$out/$other-batches.log")
        done
        if [ -f /tmp/sglang-server2.log ]; then  # a second server, when held (gpu_hold.sh server2)
            this_run /tmp/sglang-server2.log > "$out/server2-batches.log" || true
            [ -s "$out/server2-batches.log" ] && engines+=(server2="$out/server2-batches.log")
        fi
        # The decode workers' own counts: KV-event batches relayed (SGLang's events reach the stream) and canaries
        # by outcome (under steady load there should be none but the first).
        rm -f "$out/decode-counters.txt"
        for stack_port in a=9102 b=9112 c=9122; do
            curl -sf "http://127.0.0.1:${stack_port#*=}/metrics" 2>/dev/null \
                | grep -E '^conveyor_(kv_event_batches|canaries)_total' | sed "s/^/${stack_port%=*}: /" \
                >> "$out/decode-counters.txt" || true
        done
        cat "$out/decode-counters.txt" 2>/dev/null || true
        if [ -s "$out/server-batches.log" ] && [ -s "$out/conveyor-batches.log" ]; then
            # How fast each engine itself stepped, apart from what the pipeline does with its tokens.
            by_time=(); if [ -f "$dir/together" ]; then by_time=(--by-time 20); fi
            python3 scripts/sglang_steps.py "${engines[@]}" --min-running 32 "${by_time[@]}" \
                > "$out/engine-steps.txt" 2>&1 || true
            cat "$out/engine-steps.txt"
            # One stream's steps apart: a step is short there, and any CPU work in a scheduler's loop shows
            # (docs/performance.md, thirty-first stop). Left out where an engine never ran one request alone.
            python3 scripts/sglang_steps.py "${engines[@]}" --min-running 1 --max-running 1 "${by_time[@]}" \
                > "$out/engine-steps-one.txt" 2>&1 || rm -f "$out/engine-steps-one.txt"
            cat "$out/engine-steps-one.txt" 2>/dev/null || true
            # 16 streams' steps apart (12–16 running): the level the thirty-fifth stop's one run missed, its engine
            # stepping 0.95× the server's there, which the 32-and-more table above leaves out.
            python3 scripts/sglang_steps.py "${engines[@]}" --min-running 12 --max-running 16 "${by_time[@]}" \
                > "$out/engine-steps-16.txt" 2>&1 || rm -f "$out/engine-steps-16.txt"
            cat "$out/engine-steps-16.txt" 2>/dev/null || true
            # Each level of the aiperf step apart, at its steady running count (a level named twice, as in
            # GOALS_LEVELS="16 256 16", read as 16 and 16#2).
            if [ -f "$dir/aiperf.log" ]; then
                python3 scripts/sglang_steps.py "${engines[@]}" --levels "$dir/aiperf.log" \
                    > "$out/engine-steps-levels.txt" 2>&1 || rm -f "$out/engine-steps-levels.txt"
                cat "$out/engine-steps-levels.txt" 2>/dev/null || true
            fi
            # Each round split at the stack's first canary under load (since the twenty-ninth stop there should be
            # none: a canary in SGLang's running batch slowed every later step of it).
            rm -f "$out/canary-split.txt"
            split_rounds() {  # split_rounds TITLE ARG...: one table of steps_around_canaries.py, titled
                { echo "$1:"; python3 scripts/steps_around_canaries.py "$out" "${@:2}"; } \
                    >> "$out/canary-split.txt" 2>&1 || true
            }
            for stack in conveyor b c; do
                [ -s "$out/$stack-batches.log" ] || continue
                split_rounds "$stack" --stack "$stack"
                # Against SGLang's own server given the stack's engine settings, where one ran: what SGLang charges
                # for the settings apart from what the stack adds.
                if [ -s "$out/server2-batches.log" ]; then
                    split_rounds "$stack against server2" --stack "$stack" --against server2
                fi
            done
            if [ -s "$out/server2-batches.log" ]; then split_rounds server2 --stack server2; fi
            cat "$out/canary-split.txt" 2>/dev/null || true
        fi
        if [ -s "$dir/sched.log" ]; then  # each scheduler's wait for a CPU, over its loaded intervals
            bash scripts/gpu_run.sh python3 scripts/sched_wait.py --summary "$dir/sched.log" > "$out/sched-wait.txt" 2>&1 || true
            cat "$out/sched-wait.txt"
        fi
        if [ -f "$dir/proc-stat-start" ]; then  # time the host took from each CPU (a VM's steal), start to end or now
            stat_end=/proc/stat; [ -f "$dir/proc-stat-end" ] && stat_end="$dir/proc-stat-end"
            python3 scripts/cpu_steal.py "$dir/proc-stat-start" "$stat_end" > "$out/cpu-steal.txt" 2>&1 || true
            cat "$out/cpu-steal.txt"
        fi
        if [ -s "$dir/profile.json" ]; then  # the schedulers' profiles (GOALS_PROFILE_AT)
            cp "$dir/profile.json" "$out/" && tar -C "$dir/profile" -czf "$out/profiles.tgz" . 2>/dev/null || true
        fi
        gc_dir=${CONVEYOR_GC_PROBE_DIR:-/tmp/gc}
        if ls "$gc_dir"/gc-*.jsonl > /dev/null 2>&1; then  # each process's garbage collections (scripts/gc_probe)
            levels=(); [ -f "$dir/aiperf.log" ] && levels=(--levels "$dir/aiperf.log")
            { python3 scripts/gc_report.py "$gc_dir" --title scheduler "${levels[@]}"
              python3 scripts/gc_report.py "$gc_dir"; } > "$out/gc.txt" 2>&1 || true
            cat "$out/gc.txt"
            tar -C "$gc_dir" -cJf "$out/gc-probe.tar.xz" . 2>/dev/null || true
        fi
        if [ -s "$dir/gpu-clocks.log" ]; then  # how each GPU ran under load
            python3 scripts/gpu_clocks.py "$dir/gpu-clocks.log" > "$out/gpu-clocks.txt" 2>&1 || true
            cat "$out/gpu-clocks.txt"
        fi
        if grep -q "server_args=ServerArgs(" /tmp/sglang-server.log 2>/dev/null; then
            # The two engines' settings, where they differ (each logs them at start when at info).
            python3 scripts/sglang_args_diff.py /tmp/sglang-server.log /tmp/a/bench-vs-sglang-conveyor/decode.log \
                > "$out/engine-args-diff.txt" 2>&1 || true
            for other in b c; do  # stacks b's and c's against stack a's
                [ -f "/tmp/$other/bench-vs-sglang-conveyor/decode.log" ] || continue
                { echo "stack a | stack $other:"; python3 scripts/sglang_args_diff.py \
                    /tmp/a/bench-vs-sglang-conveyor/decode.log "/tmp/$other/bench-vs-sglang-conveyor/decode.log"
                } >> "$out/engine-args-diff.txt" 2>&1 || true
            done
            if [ -f /tmp/sglang-server2.log ]; then  # the second server's against the first's
                { echo "server | server2:"; python3 scripts/sglang_args_diff.py /tmp/sglang-server.log /tmp/sglang-server2.log
                } >> "$out/engine-args-diff.txt" 2>&1 || true
            fi
            cat "$out/engine-args-diff.txt"
        fi
        cat "$dir/progress.log"
        if [ -f "$dir/aiperf.log" ]; then  # each level's rounds so far, and the goals once the step has ended
            grep -E "^concurrency |tok/s ratio by round:|^  c=" "$dir/aiperf.log" || true
        fi
        if [ -f "$dir/done" ]; then echo "[gpu-goals] done"; else echo "[gpu-goals] still running"; fi
        # One file back, small enough to carry in the tree afterwards (docs/results/): the raw CPU samples and the
        # runner's own output stay behind, what the summaries above were read from goes compressed.
        (cd "$out" && rm -f run.log sched.log && for big in top.log gpu-clocks.log *batches.log *-aiperf.log; do
            [ -f "$big" ] && xz -9 -f "$big"; done) || true
        tar -cf "$out.tar" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out"
        echo "[gpu-goals] packed $out.tar"
        ;;
    *)
        sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac
