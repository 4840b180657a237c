"""CPU per streamed token of our incremental detokenizer (workers/engines/detokenizer.py), one token per call as a
decode worker would feed it, through transformers' fast tokenizer and through the `tokenizers` library directly.

What it is for: SGLang's `skip_tokenizer_init` takes its detokenizer process off every token's path, and the text would
then be ours to make in the decode worker (docs/performance.md, "Untried lead for the first token"). This is what that
would add to the decode worker's CPU per token, measured side by side in one run:

    .venv/bin/python scripts/bench_detokenize.py
    .venv/bin/python scripts/bench_detokenize.py --model /path/to/hf-model --tokens 4000 --stop "</s>" --stop "###"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.engines.detokenizer import Decoder, IncrementalDetokenizer  # noqa: E402


def us_per_token(tokenizer: Decoder, token_ids: list[int], stop: list[str], runs: int) -> tuple[float, str]:
    """The least CPU microseconds per token over `runs`, and the text it made (to check both agree)."""
    best_s, text = float("inf"), ""
    for _ in range(runs):
        detokenizer = IncrementalDetokenizer(tokenizer, stop)
        started_s = time.process_time()
        text = "".join(detokenizer.add([token_id]) for token_id in token_ids) + detokenizer.flush()
        best_s = min(best_s, (time.process_time() - started_s) / len(token_ids))
    return best_s * 1e6, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="A Hugging Face model folder with tokenizer.json (default: the bundled SmolLM2-135M).")
    parser.add_argument("--text", type=Path, default=ROOT / "README.md", help="Text whose tokens are streamed.")
    parser.add_argument("--tokens", type=int, default=2000, help="Tokens streamed per run.")
    parser.add_argument("--stop", action="append", default=[], help="A stop string (repeatable); none by default.")
    parser.add_argument("--runs", type=int, default=3, help="Runs per tokenizer; the fastest counts.")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from workers.engines.torch_engine.loader import bundled_smollm2

    model = args.model or bundled_smollm2()
    fast = AutoTokenizer.from_pretrained(str(model))
    token_ids = fast(args.text.read_text()[: args.tokens * 20])["input_ids"][: args.tokens]
    print(f"{len(token_ids)} tokens of {args.text.name}, one per call, model {model.name}, fastest of {args.runs} runs")
    fast_us, fast_text = us_per_token(fast, token_ids, args.stop, args.runs)
    # The Rust tokenizer under transformers' fast one, which the SGLang engine decodes with when SGLang runs without
    # its tokenizer (sglang_engine.own_decoder).
    direct_us, direct_text = us_per_token(fast.backend_tokenizer, token_ids, args.stop, args.runs)
    print(f"  transformers fast tokenizer: {fast_us:6.1f} µs per token")
    print(f"  tokenizers directly:         {direct_us:6.1f} µs per token ({direct_us / fast_us:.2f}× of transformers)")
    print(f"  same text from both: {fast_text == direct_text}")


if __name__ == "__main__":
    main()
