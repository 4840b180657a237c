"""Qwen2-VL-family models (Qwen2-VL, Qwen2.5-VL) for SGLang deployments: the tokens that stand for an
image, and the vision tower that encode workers run so that SGLang takes the rows as
`precomputed_embeddings` (Dynamo's E/PD and E/P/D with SGLang do the same).

An image is `<|vision_start|><|image_pad|><|vision_end|>` in the prompt the processor makes; the encode
worker runs Hugging Face's image processor (dynamic resolution within the model's `min_pixels` /
`max_pixels`) and the model's vision transformer + patch merger, and expands the one `<|image_pad|>` to
as many as the image has rows (grid t·h·w ÷ merge²). The (t, h, w) grid travels with the rows: SGLang
needs it to place the image's tokens with M-RoPE.

Weights: the model directory's `visual.*` tensors when its safetensors hold them; otherwise the tower is
built from the config with a fixed seed, as `load_format=dummy` builds SGLang's language model (say so
in logs: the rows are of the right shape, not of a trained model).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import structlog
import torch

from workers.engines.protocol import EncodedImage

log = structlog.get_logger(__name__)

QWEN_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
_SEED = 1234
# Checkpoints name the tower's tensors `visual.*` (transformers 5 saves `model.visual.*`).
_WEIGHT_PREFIXES = ("visual.", "model.visual.")


def is_qwen_vl(config: dict[str, Any]) -> bool:
    return config.get("model_type") in QWEN_VL_MODEL_TYPES and "vision_config" in config


def image_tokens(config: dict[str, Any]) -> tuple[int, int, int]:
    """What the processor puts where an image goes: vision start, the image pad (the placeholder), vision end."""
    return config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]


class QwenVisionTower:
    """The `ImageTower` of a Qwen2-VL-family model directory. Loaded on first use (in the encoding thread), so an
    LLM worker that never encodes an image in-process never holds it."""

    def __init__(self, model_dir: Path, config: dict[str, Any], device: str | None = None) -> None:
        """`config`: the directory's config.json, as read."""
        self._model_dir = model_dir
        self._model_type = config["model_type"]
        self._image_token_id = int(config["image_token_id"])
        self._merge_size = int(config["vision_config"].get("spatial_merge_size", 2))
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._dtype = torch.bfloat16 if self._device.type == "cuda" else torch.float32
        self._loaded_processor: Any = None
        self._loaded_model: Any = None
        self._load_lock = threading.Lock()

    @property
    def placeholder_id(self) -> int:
        return self._image_token_id

    def pad_ids(self, content_hash: int, num_rows: int) -> list[int]:
        # SGLang derives each image's pad value from the embeddings it receives; the prompt carries the pad token.
        return [self._image_token_id] * num_rows

    def prepare(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixel patches [patches, C·T·P·P] and the (t, h, w) grid of one image."""
        inputs = self._processor()(images=[image.convert("RGB")], return_tensors="pt")
        return inputs["pixel_values"], inputs["image_grid_thw"][0]

    @torch.inference_mode()
    def encode(self, prepared: list[tuple[torch.Tensor, torch.Tensor]]) -> list[EncodedImage]:
        model = self._model()
        grids = torch.stack([grid for _, grid in prepared])
        pixels = torch.cat([patches for patches, _ in prepared]).to(self._device, self._dtype)
        rows = model(pixels, grid_thw=grids.to(self._device)).pooler_output.float().cpu()
        sizes = (grids.prod(-1) // self._merge_size**2).tolist()
        return [EncodedImage(chunk.contiguous(), (int(t), int(h), int(w)))
                for chunk, (t, h, w) in zip(rows.split(sizes), grids.tolist())]

    def _processor(self) -> Any:
        with self._load_lock:
            if self._loaded_processor is None:
                self._loaded_processor = self._image_processor()
            return self._loaded_processor

    def _model(self) -> Any:
        with self._load_lock:
            if self._loaded_model is None:
                self._loaded_model = self._vision_model()
            return self._loaded_model

    def _image_processor(self) -> Any:
        # The PIL backend: the torchvision one (AutoProcessor's choice) is not needed to prepare pixels.
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(str(self._model_dir))

    def _vision_model(self) -> Any:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self._model_dir))
        if self._model_type == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as VisionModel,
            )
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import (
                Qwen2VisionTransformerPretrainedModel as VisionModel,
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            model = VisionModel._from_config(config.vision_config, attn_implementation="sdpa", dtype=self._dtype)
        weights = self._checkpoint_weights()
        if weights:
            model.load_state_dict(weights)
        log.info("vision.loaded", model=str(self._model_dir), device=str(self._device),
                 weights="checkpoint" if weights else "seeded (no visual.* tensors in the model directory)")
        return model.to(self._device).eval()

    def _checkpoint_weights(self) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        weights: dict[str, torch.Tensor] = {}
        for path in sorted(self._model_dir.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as tensors:
                for name in tensors.keys():
                    prefix = next((p for p in _WEIGHT_PREFIXES if name.startswith(p)), None)
                    if prefix is not None:
                        weights[name[len(prefix):]] = tensors.get_tensor(name).to(self._dtype)
        return weights
