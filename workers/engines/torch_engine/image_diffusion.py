"""Text-to-image with diffusers on torch: a Stable-Diffusion-shaped pipeline, one request at a time.

A real model directory in diffusers' layout (`model_index.json`) loads as it is. The default,
`tiny-sd-seeded`, is a small pipeline (UNet, VAE, CLIP text encoder, a byte-level tokenizer) built from
a config with a fixed seed, because no image-diffusion weights ship in any installable package: its
images have the asked size and format and are reproducible from their seed, but they are not pictures
of anything. It is saved once as a diffusers directory under the model cache and loaded from there, so
the default and a real model go the same way.

Progress: `generate` calls `on_step(step, num_steps)` after each denoising step, from the pipeline's
thread; a step callback returning True (cancelled) stops denoising before the next step.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.engines.torch_engine.loader import built_once

SEEDED_IMAGE_MODEL = "tiny-sd-seeded"
_SEED = 20_240_601
# Largest image, in pixels: a bound on the memory one request may take (a 1792x1024 image fits).
MAX_PIXELS = 1792 * 1024
MIN_SIDE_PX = 64


@dataclass(frozen=True, slots=True)
class ImageJob:
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: float
    # Image i is drawn with seed + i.
    seed: int
    num_images: int


class ImageCancelled(Exception):
    """The request was cancelled between denoising steps."""


def resolve_image_model(model: str) -> Path:
    """A diffusers directory for `model`: a path, or the seeded default (built on first use)."""
    if model == SEEDED_IMAGE_MODEL:
        return seeded_pipeline_dir()
    path = Path(model).expanduser()
    if not (path / "model_index.json").exists():
        raise FileNotFoundError(f"image model {model!r}: no model_index.json there. Give a local diffusers "
                                f"directory (e.g. a Stable Diffusion snapshot) or {SEEDED_IMAGE_MODEL!r}.")
    return path


def is_image_model(model: str) -> bool:
    return model == SEEDED_IMAGE_MODEL or (Path(model).expanduser() / "model_index.json").exists()


def seeded_pipeline_dir() -> Path:
    return built_once(SEEDED_IMAGE_MODEL, "model_index.json", _save_seeded_pipeline)


def _save_seeded_pipeline(directory: Path) -> None:
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()
    _build_seeded_pipeline().save_pretrained(directory)


def _build_seeded_pipeline():  # type: ignore[no-untyped-def]
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(_SEED)
    tokenizer = _byte_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    unet = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=32)
    # Four blocks: latents are 1/8 of the image on a side, as in Stable Diffusion.
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32, 64, 64), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
        sample_size=256)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def _byte_tokenizer():  # type: ignore[no-untyped-def]
    """A byte-level tokenizer (every byte a token, no merges), in CLIP's shape: start and end tokens, 77 long."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    start, end = "<|startoftext|>", "<|endoftext|>"
    vocab = {start: 0, end: 1} | {char: index + 2 for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{start} $A {end}", special_tokens=[(start, 0), (end, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=start, eos_token=end, pad_token=end,
                                   model_max_length=77)


class ImageGenerator:
    """One diffusers pipeline; requests run one after another (its scheduler keeps per-run state)."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        from diffusers import DiffusionPipeline
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        # A worker's stderr is its log: no progress bars from loading.
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        self.model_dir = model_dir
        self._pipeline = DiffusionPipeline.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           low_cpu_mem_usage=False).to(device)
        self._pipeline.set_progress_bar_config(disable=True)
        self._lock = threading.Lock()
        self.scale_px = int(getattr(self._pipeline, "vae_scale_factor", 8))
        side = self._pipeline.unet.config.sample_size * self.scale_px
        self.default_size = (side, side)
        smallest = -(-MIN_SIDE_PX // self.scale_px) * self.scale_px
        self.smallest_size = (smallest, smallest)

    def check_size(self, width: int, height: int) -> str | None:
        """Why this size cannot be made, or None."""
        if width % self.scale_px or height % self.scale_px:
            return f"width and height must be multiples of {self.scale_px} pixels"
        if min(width, height) < MIN_SIDE_PX:
            return f"width and height must be at least {MIN_SIDE_PX} pixels"
        if width * height > MAX_PIXELS:
            return f"{width}x{height} is more than {MAX_PIXELS} pixels"
        return None

    def generate(self, job: ImageJob, on_step: Callable[[int, int], bool]) -> list[bytes]:
        """PNG bytes of each image; raises ImageCancelled when `on_step` asks to stop."""
        cancelled = False

        def step_end(pipeline, step: int, timestep: int, tensors: dict) -> dict:  # type: ignore[no-untyped-def,type-arg]
            nonlocal cancelled
            if on_step(step + 1, job.num_inference_steps):
                cancelled = True
                pipeline._interrupt = True  # diffusers' own stop flag: the remaining steps are skipped
            return tensors

        generators = [torch.Generator().manual_seed(job.seed + index) for index in range(job.num_images)]
        with self._lock, torch.inference_mode():
            result = self._pipeline(
                prompt=job.prompt, negative_prompt=job.negative_prompt, width=job.width, height=job.height,
                num_inference_steps=job.num_inference_steps, guidance_scale=job.guidance_scale,
                num_images_per_prompt=job.num_images, generator=generators, callback_on_step_end=step_end)
        if cancelled:
            raise ImageCancelled
        return [_png(image) for image in result.images]


def _png(image) -> bytes:  # type: ignore[no-untyped-def]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
