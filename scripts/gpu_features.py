"""The OpenAI features through the whole pipeline on SGLang (GPU machine): starts `conveyor up --engine sglang --gateway`
on a model directory (dummy weights are enough: constrained output parses whatever the weights), then sends
structured-output, tool-call, logprobs, n > 1, best_of and session requests over HTTP, serves a LoRA adapter with
`conveyor lora load` when given one, drives the expert-distribution recorder, and prints one JSON line per check.

    bash scripts/gpu_run.sh python3 scripts/gpu_features.py --model .gpu/smol [--lora .gpu/lora]

With --lora the engine starts with CONVEYOR_SGLANG_ENABLE_LORA=true.

Plain HTTP (urllib), so nothing beyond Conveyor's dependencies is needed there.
"""

from __future__ import annotations

import argparse
import itertools
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

    def best_of() -> tuple[bool, str]:
        answer = post(base, "/v1/completions", {"model": model, "prompt": "Once", "max_tokens": 8, "temperature": 1.0,
                                                "n": 2, "best_of": 4})
        return ([c["index"] for c in answer["choices"]] == [0, 1] and answer["usage"]["completion_tokens"] > 0,
                json.dumps([c["text"] for c in answer["choices"]])[:200])

    def session() -> tuple[bool, str]:
        turn = {"model": model, "max_tokens": 8, "temperature": 0.0, "session_id": f"s{time.time_ns()}"}
        first = post(base, "/v1/completions", turn | {"prompt": "The sea is wide and deep and old."})["usage"]
        second = post(base, "/v1/completions", turn | {"prompt": " And the sky?", "close_session": True})["usage"]
        alone = post(base, "/v1/completions", {k: v for k, v in turn.items() if k != "session_id"}
                     | {"prompt": " And the sky?"})["usage"]
        grew = second["prompt_tokens"] == first["total_tokens"] + alone["prompt_tokens"]
        return grew, json.dumps({"first": first, "second": second, "alone": alone})[:300]

    for name, check in [("json_schema", json_schema), ("guided_regex", regex), ("guided_choice", choice),
                        ("tool_choice named", tool_call), ("logprobs", logprobs), ("n=3", n_choices),
                        ("best_of=4 n=2", best_of), ("session", session)]:
        try:
            ok, detail = check()
        except Exception as error:  # an HTTP error or a malformed answer: recorded, and the next check runs
            ok, detail = False, f"{type(error).__name__}: {error}"
        yield name, ok, detail


def lora_checks(base: str, model: str, adapter: str) -> Iterator[tuple[str, bool, str]]:
    """Serve the adapter over the bus, ask the base model and the adapter the same question, unload it."""
    ask = {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 12, "temperature": 0.0}
    loaded = subprocess.run([sys.executable, "-m", "workers.cli", "lora", "load", "tuned", adapter, "--model", model],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    yield "lora load", loaded.returncode == 0 and "loaded on 1" in loaded.stdout, (loaded.stdout + loaded.stderr)[-300:]
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as response:
            listed = json.loads(response.read())["data"]
        yield "lora in /v1/models", any(m["id"] == "tuned" and m["parent"] == model for m in listed), json.dumps(listed)[:200]
        # The first token's log-probability shows the adapter at work even where greedy text does not change.
        plain, tuned = (post(base, "/v1/chat/completions", ask | {"model": name, "logprobs": True})["choices"][0]
                        for name in (model, "tuned"))
        first = [choice["logprobs"]["content"][0]["logprob"] for choice in (plain, tuned)]
        texts = [choice["message"]["content"] for choice in (plain, tuned)]
        yield "lora changes the answer", texts[0] != texts[1] or abs(first[0] - first[1]) > 1e-3, \
            json.dumps({"texts": texts, "first_logprobs": first})[:300]
    except Exception as error:
        yield "lora request", False, f"{type(error).__name__}: {error}"
    unloaded = subprocess.run([sys.executable, "-m", "workers.cli", "lora", "unload", "tuned"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    yield "lora unload", unloaded.returncode == 0, (unloaded.stdout + unloaded.stderr)[-300:]


def expert_checks() -> Iterator[tuple[str, bool, str]]:
    """start / stop / dump of the expert-distribution recorder on the decode worker (a dense model may refuse)."""
    status = subprocess.run([sys.executable, "-m", "workers.cli", "status"], cwd=ROOT, capture_output=True, text=True)
    urls = [match for line in status.stdout.splitlines() if " decode " in line
            for match in re.findall(r"(http://\S+)/metrics", line)]
    for action in ("start", "stop", "dump"):
        try:
            answer = post(urls[-1], f"/engine/{action}_expert_distribution_record", {})
            yield f"experts {action}", bool(answer.get("success")), json.dumps(answer)[:200]
        except Exception as error:
            body = error.read().decode()[:200] if hasattr(error, "read") else ""
            yield f"experts {action}", False, f"{type(error).__name__}: {error} {body}"


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
    parser.add_argument("--lora", help="A PEFT adapter directory for the model: served, asked, unloaded.")
    parser.add_argument("--load-format", default="dummy", help="dummy (random weights from config.json) or auto. "
                        "SGLang loads no LoRA adapter onto a dummy-loaded model: give --lora a model with weights.")
    parser.add_argument("--expert-recorder", help="Start the engine with this expert-distribution recorder mode (stat, "
                        "per_pass, ...); without one the recorder routes are refused.")
    args = parser.parse_args()
    # Random weights fill JSON with legal whitespace until max_tokens unless SGLang's grammar forbids it.
    env = os.environ | {"CONVEYOR_SGLANG_EXTRA_SERVER_ARGS": json.dumps({"constrained_json_disable_any_whitespace": True})}
    env |= {"CONVEYOR_SGLANG_ENABLE_LORA": "true"} if args.lora else {}
    env |= {"CONVEYOR_SGLANG_EXPERT_DISTRIBUTION_RECORDER_MODE": args.expert_recorder} if args.expert_recorder else {}
    up = subprocess.Popen([sys.executable, "-m", "workers.cli", "up", "--engine", "sglang", "--model", args.model,
                           "--load-format", args.load_format, "--gateway", "--gateway-port", str(args.port)],
                          cwd=ROOT, env=env)
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
        results = itertools.chain(checks(base, args.model), lora_checks(base, args.model, args.lora) if args.lora else [],
                                  expert_checks())
        for name, ok, detail in results:
            print("FEATURE " + json.dumps({"check": name, "ok": ok, "detail": detail}), flush=True)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)


if __name__ == "__main__":
    main()
