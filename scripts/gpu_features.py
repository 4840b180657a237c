"""The OpenAI features through the whole pipeline on SGLang (GPU machine): starts `conveyor up --engine sglang --gateway`
on a model directory (dummy weights are enough: constrained output parses whatever the weights), then sends
structured-output, tool-call, logprobs and n > 1 requests over HTTP and prints one JSON line per check.

    bash scripts/gpu_run.sh python3 scripts/gpu_features.py --model .gpu/smol

Plain HTTP (urllib), so nothing beyond Conveyor's dependencies is needed there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from collections.abc import Iterator
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "country": {"enum": ["France", "Italy"]},
                                           "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "country", "population_millions"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def checks(base: str, model: str) -> Iterator[tuple[str, bool, str]]:
    """Each feature's request and whether its answer holds; a request that fails is a failed check, not the end."""
    ask = [{"role": "user", "content": "Name a city."}]
    chat = {"model": model, "messages": ask, "max_tokens": 96, "temperature": 0.0}

    def json_schema() -> tuple[bool, str]:
        text = post(base, "/v1/chat/completions", chat | {"response_format": {
            "type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}})[
            "choices"][0]["message"]["content"]
        parsed = _json(text)
        return (isinstance(parsed, dict) and set(parsed) == set(SCHEMA["properties"])
                and parsed.get("country") in ("France", "Italy")), text

    def regex() -> tuple[bool, str]:
        text = post(base, "/v1/chat/completions", chat | {"guided_regex": "[0-9]{3}-[0-9]{4}"})[
            "choices"][0]["message"]["content"]
        return re.fullmatch("[0-9]{3}-[0-9]{4}", text) is not None, text

    def choice() -> tuple[bool, str]:
        text = post(base, "/v1/chat/completions", chat | {"guided_choice": ["yes", "no"]})["choices"][0]["message"][
            "content"]
        return text in ("yes", "no"), text

    def tool_call() -> tuple[bool, str]:
        answer = post(base, "/v1/chat/completions", chat | {"tools": [TOOL], "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}})
        calls = answer["choices"][0]["message"].get("tool_calls") or []
        return (answer["choices"][0]["finish_reason"] == "tool_calls" and len(calls) == 1
                and isinstance(_json(calls[0]["function"]["arguments"]), dict)), json.dumps(calls)[:200]

    def logprobs() -> tuple[bool, str]:
        answer = post(base, "/v1/chat/completions", chat | {"max_tokens": 8, "logprobs": True, "top_logprobs": 2})
        entries = (answer["choices"][0].get("logprobs") or {}).get("content") or []
        return (len(entries) == answer["usage"]["completion_tokens"] and all(
            e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in entries)), json.dumps(entries[:2])[:200]

    def n_choices() -> tuple[bool, str]:
        answer = post(base, "/v1/chat/completions", chat | {"n": 3, "max_tokens": 8, "temperature": 1.0})
        return ([c["index"] for c in answer["choices"]] == [0, 1, 2],
                json.dumps([c["message"]["content"] for c in answer["choices"]])[:200])

    for name, check in [("json_schema", json_schema), ("guided_regex", regex), ("guided_choice", choice),
                        ("tool_choice named", tool_call), ("logprobs", logprobs), ("n=3", n_choices)]:
        try:
            ok, detail = check()
        except Exception as error:  # an HTTP error or a malformed answer: recorded, and the next check runs
            ok, detail = False, f"{type(error).__name__}: {error}"
        yield name, ok, detail


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--start-timeout-s", type=float, default=420)
    args = parser.parse_args()
    up = subprocess.Popen([sys.executable, "-m", "workers.cli", "up", "--engine", "sglang", "--model", args.model,
                           "--load-format", "dummy", "--gateway", "--gateway-port", str(args.port)],
                          cwd=ROOT, env=os.environ.copy())
    base = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + args.start_timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as response:
                    if args.model in response.read().decode():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or up.poll() is not None:
                raise SystemExit("the pipeline did not come up")
            time.sleep(2)
        for name, ok, detail in checks(base, args.model):
            print("FEATURE " + json.dumps({"check": name, "ok": ok, "detail": detail}), flush=True)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


if __name__ == "__main__":
    main()
