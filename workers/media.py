"""Images in, embedding rows out: what the encode stage does, and what an LLM worker does in-process
when no encode worker is live (EPD).

- Loading (`load_media`): `data:image/...;base64,` URLs, `file://` paths this worker can read, and
  `http(s)://` URLs fetched with a time and size limit — all items of a request concurrently.
  Limits (`MediaLimits`, from `CONVEYOR_MEDIA_*`): images per request, bytes per image, pixels per
  image (decompression bombs are refused from the header, before any pixel is decoded).
- Encoding (`MediaEncoder.encode`): the model's vision tower (an `ImageTower`: the torch engine's seeded
  tower, or a Qwen2-VL-family tower for SGLang) runs on the images not in the LRU cache (keyed by the
  content hash of the media bytes, sized in bytes), and each image's one placeholder token is expanded
  to as many tokens as the image has rows (the tower's `pad_ids`).

Fails how: every problem with the media itself — not an image, truncated, too large, too many,
unreachable, a scheme we do not read, fewer placeholders than images — is a `MediaError` with the
client-facing error code; nothing here kills a worker.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import aiohttp
import structlog
import torch
import xxhash
from PIL import Image
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bus.metrics import MEDIA_CACHE, MIGRATIONS
from schemas.replies import ErrorCode
from schemas.tasks import EncodedImages, MediaItem, NixlHandle
from workers.engines.protocol import EncodedImage, ImageGrid, ImageTower, TransferFailed
from workers.media_transfer import EmbeddingReader

log = structlog.get_logger(__name__)


class MediaError(ValueError):
    """Media a request cannot be served with; `code` is what the client is told."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class MediaLimits(BaseSettings):
    """Bounds on what one request may make a worker load (CONVEYOR_MEDIA_* variables)."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_MEDIA_", frozen=True)

    max_images: int = Field(default=16, ge=1)
    max_image_bytes: int = Field(default=20 << 20, ge=1024)
    # Width × height; checked from the header, so a decompression bomb is never decoded.
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    fetch_timeout_s: float = Field(default=10.0, gt=0)
    # Bytes of embedding rows the encode cache keeps (least recently used go first).
    cache_bytes: int = Field(default=256 << 20, ge=0)
    # The encode worker's NIXL export pool: rows waiting for their LLM worker to read them.
    export_pool_bytes: int = Field(default=64 << 20, ge=1 << 20)


@dataclass(frozen=True, slots=True)
class LoadedImage:
    image: Image.Image
    content_hash: int


async def load_media(items: list[MediaItem], limits: MediaLimits) -> list[LoadedImage]:
    if len(items) > limits.max_images:
        raise MediaError(ErrorCode.INVALID_REQUEST, f"{len(items)} images in one request; at most {limits.max_images}")
    for item in items:
        if item.modality != "image":
            raise MediaError(ErrorCode.UNSUPPORTED, f"{item.modality} input is not supported by this model family")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limits.fetch_timeout_s)) as session:
        raw = await asyncio.gather(*(_fetch(item.source.url, limits, session) for item in items))
    # Decoding is CPU work (tens of ms for a large image): in threads, off the event loop that keeps
    # heartbeats and acks going; Pillow releases the GIL while it decodes, so images decode in parallel.
    images = await asyncio.gather(*(asyncio.to_thread(_decode_image, data, limits, index)
                                    for index, data in enumerate(raw)))
    return [LoadedImage(image, xxhash.xxh3_64_intdigest(data)) for image, data in zip(images, raw, strict=True)]


async def _fetch(url: str, limits: MediaLimits, session: aiohttp.ClientSession) -> bytes:
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(url, limits)
    if scheme == "file":
        return await asyncio.to_thread(_read_file, Path(unquote(urlparse(url).path)), limits)
    if scheme in ("http", "https"):
        return await _download(url, limits, session)
    raise MediaError(ErrorCode.INVALID_REQUEST, f"image URL scheme {scheme!r} is not read here (data:, file://, http(s)://)")


def _data_url(url: str, limits: MediaLimits) -> bytes:
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise MediaError(ErrorCode.INVALID_REQUEST, "a data URL must be data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise MediaError(ErrorCode.INVALID_REQUEST, f"image larger than {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise MediaError(ErrorCode.INVALID_REQUEST, f"data URL is not valid base64: {error}") from error


def _read_file(path: Path, limits: MediaLimits) -> bytes:
    try:
        size = path.stat().st_size
        if size > limits.max_image_bytes:
            raise MediaError(ErrorCode.INVALID_REQUEST, f"{path} is {size} bytes; at most {limits.max_image_bytes}")
        return path.read_bytes()
    except OSError as error:
        raise MediaError(ErrorCode.INVALID_REQUEST, f"cannot read {path}: {error.strerror}") from error


async def _download(url: str, limits: MediaLimits, session: aiohttp.ClientSession) -> bytes:
    try:
        async with session.get(url) as response:
            if response.status != 200:
                raise MediaError(ErrorCode.INVALID_REQUEST, f"fetching {url} answered HTTP {response.status}")
            body = bytearray()
            async for piece in response.content.iter_chunked(1 << 16):
                body += piece
                if len(body) > limits.max_image_bytes:
                    raise MediaError(ErrorCode.INVALID_REQUEST, f"{url} is larger than {limits.max_image_bytes} bytes")
            return bytes(body)
    except (aiohttp.ClientError, TimeoutError) as error:
        reason = "timed out" if isinstance(error, TimeoutError) else str(error) or type(error).__name__
        raise MediaError(ErrorCode.INVALID_REQUEST, f"cannot fetch {url}: {reason}") from error


def _decode_image(data: bytes, limits: MediaLimits, index: int) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise MediaError(ErrorCode.INVALID_REQUEST,
                             f"image {index} is {width}×{height} pixels; at most {limits.max_image_pixels}")
        image.load()
        return image
    except MediaError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise MediaError(ErrorCode.INVALID_REQUEST, f"image {index} is not a decodable image: {error}") from error


class EmbeddingCache:
    """Encoded images per content hash, least recently used evicted first, bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._images: OrderedDict[int, EncodedImage] = OrderedDict()

    def get(self, content_hash: int) -> EncodedImage | None:
        image = self._images.get(content_hash)
        MEDIA_CACHE.labels(result="hit" if image is not None else "miss").inc()
        if image is not None:
            self._images.move_to_end(content_hash)
        return image

    def put(self, content_hash: int, image: EncodedImage) -> None:
        size = _size_bytes(image)
        if size > self.capacity_bytes or content_hash in self._images:
            return
        self._images[content_hash] = image
        self.size_bytes += size
        while self.size_bytes > self.capacity_bytes:
            _, evicted = self._images.popitem(last=False)
            self.size_bytes -= _size_bytes(evicted)


def _size_bytes(image: EncodedImage) -> int:
    return image.rows.numel() * image.rows.element_size()


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    # The prompt with each image placeholder expanded to its image's tokens.
    token_ids: list[int]
    # [image tokens, hidden] float32, in the order of the image tokens; None for a prompt without images.
    rows: torch.Tensor | None = None
    # Each image's (t, h, w) patch grid, for towers that report one (Qwen2-VL); None otherwise.
    grids: list[ImageGrid] | None = None


class MediaEncoder:
    """Load → cache lookup → vision tower (in a thread) → placeholder expansion."""

    def __init__(self, tower: ImageTower, limits: MediaLimits) -> None:
        self._tower = tower
        self.limits = limits
        self.cache = EmbeddingCache(limits.cache_bytes)
        # One image batch at a time: the tower uses every core already.
        self._lock = asyncio.Lock()

    @property
    def placeholder_id(self) -> int:
        return self._tower.placeholder_id

    async def encode(self, token_ids: list[int], items: list[MediaItem]) -> EncodedPrompt:
        num_placeholders = token_ids.count(self.placeholder_id)
        if num_placeholders != len(items):
            raise MediaError(ErrorCode.INVALID_REQUEST,
                             f"the prompt has {num_placeholders} image placeholders for {len(items)} images")
        images = await load_media(items, self.limits)
        encoded = await self._encoded(images)
        # A tower reports a grid for every image or for none.
        grids = [image.grid for image in encoded] if encoded and encoded[0].grid is not None else None
        return EncodedPrompt(self._expand(token_ids, images, encoded),
                             torch.cat([image.rows for image in encoded]) if encoded else None, grids)

    async def _encoded(self, images: list[LoadedImage]) -> list[EncodedImage]:
        cached = [self.cache.get(image.content_hash) for image in images]
        missing = [image for image, hit in zip(images, cached) if hit is None]
        if not missing:
            return [hit for hit in cached if hit is not None]
        # Resizing and normalizing run in parallel threads; only the tower itself runs one batch at a time.
        prepared = await asyncio.gather(*(asyncio.to_thread(self._tower.prepare, image.image) for image in missing))
        async with self._lock:
            computed = await asyncio.to_thread(self._tower.encode, prepared)
        fresh = {image.content_hash: encoded for image, encoded in zip(missing, computed)}
        for content_hash, encoded in fresh.items():
            self.cache.put(content_hash, encoded)
        return [hit if hit is not None else fresh[image.content_hash] for image, hit in zip(images, cached)]

    def _expand(self, token_ids: list[int], images: list[LoadedImage], encoded: list[EncodedImage]) -> list[int]:
        expanded: list[int] = []
        next_image = 0
        for token in token_ids:
            if token == self.placeholder_id:
                num_rows = int(encoded[next_image].rows.shape[0])
                expanded += self._tower.pad_ids(images[next_image].content_hash, num_rows)
                next_image += 1
            else:
                expanded.append(token)
        return expanded


class ImageInputs:
    """An LLM worker's view of a task's images: rows read over NIXL from an encode worker (E/PD,
    E/P/D), or encoded here from the task's media when no encode worker took it (EPD) or the encode
    worker that did died before they were read."""

    def __init__(self, encoder: MediaEncoder | None, reader_name: str, transfer_timeout_s: float = 30.0) -> None:
        self.encoder = encoder
        self._reader_name = reader_name
        # Made on the first handle: a NIXL agent only where rows actually arrive.
        self._reader: EmbeddingReader | None = None
        self._transfer_timeout_s = transfer_timeout_s

    async def resolve(self, request_id: str, token_ids: list[int], items: list[MediaItem],
                      encoded: EncodedImages | None, first_delivery: bool = True) -> EncodedPrompt:
        """The prompt to run with its image rows (none for a text prompt): read over NIXL when an encode
        worker offers them, else encoded here. Raises `MediaError`, or `TransferFailed` when the rows cannot
        be read and this worker cannot encode the images itself.

        Rows are read on a task's first delivery only: a redelivered task's rows may have been read by the
        replica that died, and the encode worker reuses a read range for other requests' rows."""
        if encoded is not None and encoded.rows is not None:
            try:
                if not first_delivery:
                    raise TransferFailed("the task was redelivered; its image rows may have been read already")
                return EncodedPrompt(encoded.token_ids, await self._read(encoded.rows, request_id), encoded.image_grids)
            except TransferFailed as error:
                if self.encoder is None or not items:
                    raise
                # The images are in the task: encode them here rather than fail the request.
                log.warning("images.encoding_here", reason=str(error))
                MIGRATIONS.labels(stage="encode", outcome="encoded_by_llm_worker").inc()
        if not items:
            return EncodedPrompt(token_ids)
        if self.encoder is None:
            raise MediaError(ErrorCode.UNSUPPORTED, "this worker's engine has no vision path; start encode workers "
                             "for the model or serve a multimodal model")
        return await self.encoder.encode(token_ids, items)

    async def _read(self, handle: NixlHandle, request_id: str) -> torch.Tensor:
        if self._reader is None:
            self._reader = EmbeddingReader(self._reader_name)
        return await asyncio.to_thread(self._reader.read, handle, request_id, self._transfer_timeout_s)
