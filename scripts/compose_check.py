"""Check a running compose stack the way a user would: ask through the gateway, then ask Prometheus every query of the
provisioned dashboard and say which return data. Prints one JSON line per check; exits 1 when a check fails.

    docker compose up -d            # or: podman-compose up -d (see README, Deployment, for a registry-less host)
    python scripts/compose_check.py [--gateway http://localhost:8000] [--prometheus http://localhost:9090]

Panels whose series only exist once something happened (migrations, cancels, errors, dead letters) may be empty on a
quiet stack; they are reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "docs/observability/grafana/dashboards/conveyor.json"
# Panels that have data once requests went through (the rest need failures, cancels or migrations to happen).
MUST_HAVE_DATA = ("Requests per second", "Time to first token", "Inter-token latency", "End to end", "Queue depth",
                  "Queue wait", "Engine requests", "KV cache usage", "Workers ready")


def get(url: str, timeout_s: float = 30.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def report(check: str, ok: bool, detail: Any) -> bool:
    print(json.dumps({"check": check, "ok": ok, "detail": detail}), flush=True)
    return ok


def wait_for_model(gateway: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            models = get(f"{gateway}/v1/models", timeout_s=5)["data"]
            if models:
                return str(models[0]["id"])
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no model became ready behind {gateway} in {timeout_s:.0f} s")
        time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="http://localhost:8000")
    parser.add_argument("--prometheus", default="http://localhost:9090")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--start-timeout-s", type=float, default=300)
    parser.add_argument("--min-targets", type=int, default=1,
                        help="Wait (up to a minute: DNS discovery refreshes every 10 s) for this many worker targets up.")
    args = parser.parse_args()
    model = wait_for_model(args.gateway, args.start_timeout_s)
    ok = True
    question = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24, "temperature": 0.0}
    started_s = time.perf_counter()
    answers = [post(f"{args.gateway}/v1/chat/completions", question) for _ in range(args.requests)]
    text = answers[0]["choices"][0]["message"]["content"]
    ok &= report("gateway answers", all(a["choices"][0]["message"]["content"] for a in answers),
                 {"answer": text, "requests": len(answers), "seconds": round(time.perf_counter() - started_s, 2)})
    deadline = time.monotonic() + 60
    while True:
        targets = get(f"{args.prometheus}/api/v1/targets")["data"]["activeTargets"]
        up = sorted(f"{t['labels'].get('service')}@{t['labels']['instance']}" for t in targets if t["health"] == "up")
        if len(up) >= args.min_targets or time.monotonic() > deadline:
            break
        time.sleep(2)
    ok &= report("prometheus scrapes every worker", len(up) >= args.min_targets, up)
    time.sleep(12)  # two scrapes after the requests, so rate() has points
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        series = 0
        for target in panel["targets"]:
            query = urllib.parse.urlencode({"query": target["expr"]})
            series += len(get(f"{args.prometheus}/api/v1/query?{query}")["data"]["result"])
        needed = panel["title"].startswith(MUST_HAVE_DATA)
        passed = report(f"panel: {panel['title']}", series > 0 or not needed, {"series": series, "required": needed})
        ok &= passed
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
