#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the test suite against a real nats-server.
# Extra arguments go to pytest, e.g. scripts/test.sh -k consumer -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite starts many nats-servers and model copies in the temp folder: say how much room it has, so a failure on
# a nearly full disk explains itself.
free_mib=$(df -Pm "${TMPDIR:-/tmp}" 2>/dev/null | awk 'NR == 2 {print $4}' || true)
if [ -n "$free_mib" ]; then
    echo "[test] ${free_mib} MiB free in ${TMPDIR:-/tmp}" >&2
    if [ "$free_mib" -lt 2048 ]; then
        echo "[test] warning: under 2 GiB free; tests that convert the model or fill streams may fail for want of room" >&2
    fi
fi
exec .venv/bin/python -m pytest "$@"
