"""The torch engine's vision path: a small ViT + projector whose output rows stand in for an image's
placeholder tokens before the first decoder layer.

No vision weights ship in any installable package, so the tower is built from `VisionConfig` with a
fixed seed: every process (encode worker, LLM worker) builds bit-identical weights, which is what
lets an image be encoded on one machine and consumed on another. The rows are real model outputs of
the right shape and dtype, but the model has not been trained: it sees an image, it does not
understand it. A model directory with `vision.safetensors` beside its weights loads those instead.

Token scheme (SGLang's, with its `pad_value`): the processor puts one placeholder id
(`placeholder_id(vocab)` = the text vocabulary size, outside it) per image; expansion replaces each
with `tokens_per_image` copies of the image's *pad id*, `1_000_000 + (hash & (2**30 - 1))` — SGLang's
multimodal pad value, so both engines key an image's blocks alike — derived from the image's content hash. Pad ids are never looked up in the embedding table; they make the
prefix-cache keys of an image's blocks depend on the image, so two images never share KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from workers.engines.protocol import EncodedImage

# SGLang's pad values: 1_000_000 + (mm_hash & (2^30 - 1)); text vocabularies stay below the base.
_PAD_BASE = 1_000_000
_PAD_MASK = 2**30 - 1


@dataclass(frozen=True, slots=True)
class VisionConfig:
    image_size: int = 112
    patch_size: int = 16
    width: int = 192
    num_layers: int = 2
    num_heads: int = 4
    # Rows per image after pooling the patch grid (a square number).
    tokens_per_image: int = 16
    seed: int = 1234

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pooled_grid(self) -> int:
        side = int(self.tokens_per_image**0.5)
        if side * side != self.tokens_per_image:
            raise ValueError(f"tokens_per_image must be a square number, got {self.tokens_per_image}")
        return side


def placeholder_id(vocab_size: int) -> int:
    """The id the processor puts where an image goes (one per image, before expansion)."""
    return vocab_size


def pad_id(vocab_size: int, content_hash: int) -> int:
    """The id every token of one image carries after expansion: outside the vocabulary, per image."""
    if vocab_size >= _PAD_BASE:
        raise ValueError(f"a vocabulary of {vocab_size} tokens overlaps the image pad ids from {_PAD_BASE}")
    return _PAD_BASE + (content_hash & _PAD_MASK)


class VisionTower(nn.Module):
    """Patch embedding → transformer encoder → pooled grid → 2-layer projector into the LM's width."""

    def __init__(self, config: VisionConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        self.patch = nn.Conv2d(3, config.width, kernel_size=config.patch_size, stride=config.patch_size)
        self.position = nn.Parameter(torch.randn(config.grid * config.grid, config.width) * 0.02)
        layer = nn.TransformerEncoderLayer(config.width, config.num_heads, dim_feedforward=config.width * 4,
                                           batch_first=True, norm_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.pool = nn.AdaptiveAvgPool2d(config.pooled_grid)
        self.projector = nn.Sequential(nn.Linear(config.width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, S, S] in [-1, 1] → rows [N, tokens_per_image, hidden]."""
        patches = self.patch(pixels).flatten(2).transpose(1, 2) + self.position  # [N, grid², width]
        encoded = self.encoder(patches)
        side = self.config.grid
        grid = encoded.transpose(1, 2).reshape(encoded.shape[0], -1, side, side)
        pooled = self.pool(grid).flatten(2).transpose(1, 2)  # [N, tokens, width]
        return self.projector(pooled)


class SeededImageTower:
    """The torch engine's `ImageTower`: every image resized to one size, `tokens_per_image` rows each, and
    expanded to its own pad id."""

    def __init__(self, tower: VisionTower, vocab_size: int) -> None:
        self._tower = tower
        self._vocab_size = vocab_size

    @property
    def placeholder_id(self) -> int:
        return placeholder_id(self._vocab_size)

    def prepare(self, image: object) -> torch.Tensor:
        return preprocess(image, self._tower.config)

    def encode(self, prepared: list[torch.Tensor]) -> list[EncodedImage]:
        rows = self._tower(torch.stack(prepared))
        return [EncodedImage(image_rows.contiguous()) for image_rows in rows]

    def pad_ids(self, content_hash: int, num_rows: int) -> list[int]:
        return [pad_id(self._vocab_size, content_hash)] * num_rows


def build_vision_tower(config: VisionConfig, hidden_size: int, model_dir: Path | None = None) -> VisionTower:
    """The seeded tower (or the model directory's `vision.safetensors`), without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        tower = VisionTower(config, hidden_size)
    weights = model_dir / "vision.safetensors" if model_dir is not None else None
    if weights is not None and weights.exists():
        from safetensors.torch import load_file

        tower.load_state_dict(load_file(str(weights)))
    return tower.eval()


def preprocess(image: object, config: VisionConfig) -> torch.Tensor:
    """A PIL image → [3, S, S] float32 in [-1, 1] (RGB, bicubic resize)."""
    from PIL import Image

    assert isinstance(image, Image.Image)
    resized = image.convert("RGB").resize((config.image_size, config.image_size), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(config.image_size, config.image_size, 3).permute(2, 0, 1).float()
    return pixels / 127.5 - 1.0
