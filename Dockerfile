# The Conveyor worker image: every stage runs from it (`conveyor worker <stage>`).
# It installs with the same script as the README's quick start (CPU torch from PyTorch's CPU index).
# BASE: any image with Python 3.11+ and its venv module (a registry-less host builds one locally; README, Deployment).
ARG BASE=python:3.11-slim
FROM ${BASE}
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bus ./bus
COPY schemas ./schemas
COPY workers ./workers
COPY scripts ./scripts
# The extras to install: torch,nixl for the CPU stages; torch,sglang for compose's gpu profile.
ARG EXTRAS=torch,nixl
# Empty: the CPU build of torch. The GPU image sets the CUDA build SGLang pins (torch==2.11.0).
ARG TORCH_SPEC=
RUN CONVEYOR_EXTRAS="$EXTRAS" CONVEYOR_TORCH_SPEC="$TORCH_SPEC" bash scripts/setup.sh && rm -rf /root/.cache/pip
ENV PATH="/app/.venv/bin:${PATH}" \
    CONVEYOR_MODEL_CACHE=/models
# Convert the bundled model once at build time, so replicas start from safetensors.
RUN python -c "from workers.engines.torch_engine.loader import bundled_smollm2; bundled_smollm2()"
ENTRYPOINT ["conveyor"]
CMD ["--help"]
