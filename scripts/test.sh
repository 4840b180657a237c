#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the test suite against a real nats-server.
# Extra arguments go to pytest, e.g. scripts/test.sh -k consumer -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
