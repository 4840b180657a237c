#!/usr/bin/env bash
# Set everything up (scripts/setup.sh), then run the main job: an embedded NATS server and the
# pipeline, with one request streamed to this terminal. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
# Without the test suite's extra (pytest, sentence-transformers and what it pulls: ~30 s of a fresh set-up);
# scripts/test.sh adds it. NIXL stays, for disaggregated serving after the quick start.
CONVEYOR_EXTRAS=${CONVEYOR_EXTRAS:-torch,nixl} bash scripts/setup.sh
exec .venv/bin/conveyor up --ask "${1:-What is the capital of France?}" --exit
