"""Write a small Qwen2-VL-shaped model directory: config, tokenizer, image-processor config — no weights.

SGLang serves it with `load_format=dummy` (random weights) and Conveyor's encode workers build its vision
tower from the config with a fixed seed, so the multimodal path (processor → encode → SGLang with
precomputed embeddings) runs on a machine with no hub access. The tokenizer and chat template are
SmolLM2's (ChatML, like Qwen's) with Qwen2-VL's five vision tokens added.

    python scripts/tiny_qwen2_vl.py .gpu/qwen2vl [--text-model DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def write(target: Path, text_model: Path) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer

    target.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(text_model / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in VISION_TOKENS])
    tokenizer.save(str(target / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in VISION_TOKENS}
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (text_model / name).exists():
            shutil.copy2(text_model / name, target / name)
    text = json.loads((text_model / "config.json").read_text())
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "bos_token_id": text.get("bos_token_id", 1), "eos_token_id": text.get("eos_token_id", 2),
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"], "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        # Qwen2-VL-2B's widths, 4 layers: small enough to start fast, shaped like the real thing (head 128, M-RoPE).
        "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 4096, "max_position_embeddings": 8192,
        "num_attention_heads": 12, "num_hidden_layers": 4, "num_key_value_heads": 2, "max_window_layers": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 8192, "use_sliding_window": False,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "vision_config": {"depth": 4, "embed_dim": 640, "mlp_ratio": 4, "num_heads": 10, "in_chans": 3,
                          "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        # Room for the added tokens, rounded up to a multiple of 64.
        "vocab_size": -(-(max(ids.values()) + 1) // 64) * 64,
    }
    (target / "config.json").write_text(json.dumps(config, indent=1))
    # At most 448 x 448 pixels: 256 image tokens at most.
    image_processor = {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": 3136, "max_pixels": 200704, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (target / "preprocessor_config.json").write_text(json.dumps(image_processor, indent=1))
    (target / "generation_config.json").write_text(json.dumps({"bos_token_id": config["bos_token_id"],
                                                               "eos_token_id": config["eos_token_id"]}))
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, help="directory to write")
    parser.add_argument("--text-model", type=Path, default=None,
                        help="a directory with tokenizer.json and config.json (default: the bundled SmolLM2)")
    args = parser.parse_args()
    if args.text_model is None:
        sys.path.insert(0, str(ROOT))
        from workers.engines.torch_engine.loader import bundled_smollm2

        args.text_model = bundled_smollm2()
    ids = write(args.target, args.text_model)
    print(f"wrote {args.target} (image token {ids['<|image_pad|>']})")


if __name__ == "__main__":
    main()
