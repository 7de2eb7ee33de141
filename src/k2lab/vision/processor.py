"""Native-resolution image / video preprocessing for MoonViT (what ``Kimi_K25ImageProcessor`` does).

Per image (H×W pixels, RGB, values in [0, 255]; p = patch size, k = merge size, S = patches per side cap,
B = total patch budget):

1. NaViT resize, aspect ratio kept, never upscaled:
   s = min(1, √(B / (max(1, ⌊H/p⌋)·max(1, ⌊W/p⌋))), S·p / H, S·p / W);  H' = min(max(1, ⌊H·s⌋), S·p), same for W'.
   Bicubic with antialias (PyTorch's kernel, taken on uint8 directly for uint8 input, as torchvision does),
   skipped when (H', W') = (H, W).
2. Zero-pad bottom / right to multiples of k·p: H'' = ⌈H' / kp⌉·kp.
3. Rescale + normalize, fused like the reference: x̂ = (x − 255·μ) / (255·σ), μ = σ = 0.5 per channel
   (so pixels land in [−1, 1] and padding becomes −1).
4. Patchify: [3, H'', W''] -> [h·w, 3, p, p] in raster order (row-major over the h = H''/p, w = W''/p grid);
   ``image_grid_thw`` row (1, h, w).

Videos (frames already sampled; [T, H, W, 3] arrays / tensors or lists of PIL frames): cut into volumes of
at most 4 consecutive frames (``video_volumes``), each resized, padded and normalized like an image (budget
B = 4096 patches per frame by default) and patchified frame-major: [t·h·w, 3, p, p], ``video_grid_thw`` (t, h, w).
These are exactly the layouts ``MoonViT3D.forward(pixel_values, grid_thw)`` expects.

PIL images become uint8 RGB first: transparency is composited onto white, 16-bit gray (modes ``I;16*``,
``I``) is scaled by 1/257 (rounded); uint16 arrays and tensors are scaled the same way. Other integer and
float arrays / tensors are taken as 0–255 values (as transformers, which rescales every input by 1/255); a
float RGBA one is composited with α in [0, 1] onto 1.0, as transformers does. An empty image or video, or
a video whose frames differ in size, raises ``ImageInputError`` (a ``ValueError``) naming it.

A PIL image at least 4× its step-1 size (H', W') per side is shrunk in PIL before any array is made, so its
full-size pixels never become arrays: a JPEG not yet loaded is decoded at 1/2, 1/4 or 1/8 scale
(``Image.draft``, which changes that image object in place), then the image is box-averaged by f =
min(⌊H/2H'⌋, ⌊W/2W'⌋) (``Image.reduce``); step 1 then resizes from ≥ 2·(H', W') to the (H', W') of the
original size. Smaller images take exactly the path above.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from k2lab.errors import K2LabError
from k2lab.vision.config import VisionConfig
from k2lab.vision.moonvit import video_volumes

__all__ = [
    "ImageBatch",
    "ImageInputError",
    "ProcessorConfig",
    "VideoBatch",
    "navit_size",
    "num_image_tokens",
    "patchify",
    "preprocess_images",
    "preprocess_videos",
    "to_chw_tensor",
]


class ImageInputError(K2LabError, ValueError):
    """An image or video the processor cannot take (empty, wrong shape, frames of different sizes); the
    message names it (``images[i]`` / ``videos[i]``)."""


@dataclass(frozen=True)
class ProcessorConfig:
    """Preprocessing knobs, defaults = transformers' ``Kimi_K25ImageProcessor`` / ``Kimi_K25VideoProcessor``.

    ``max_patches`` caps an image's patches (B), ``max_patches_per_side`` each side's (S, HF's
    ``size["max_height"]``), ``video_max_patches`` a video frame's; ``temporal_patch_size`` frames per volume.
    """

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_patches_per_side: int = 512
    video_max_patches: int = 4096
    temporal_patch_size: int = 4
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @classmethod
    def from_vision_config(cls, config: VisionConfig, **overrides: Any) -> ProcessorConfig:
        """Patch / merge / volume sizes taken from the tower (square merge kernel required); a
        pixel-shuffle (MoonViT-V2) tower gets the V2 budget of ``moonvit_v2()``."""
        kh, kw = config.merge_kernel_size
        if kh != kw:
            raise ValueError(f"the processor pads to a square merge kernel, got merge_kernel_size={(kh, kw)}")
        fields: dict[str, Any] = dict(
            patch_size=config.patch_size, merge_size=kh, temporal_patch_size=config.pos_emb_time
        )
        if config.merge == "pixel_shuffle":
            fields["max_patches"] = cls.moonvit_v2().max_patches
        return cls(**{**fields, **overrides})

    @classmethod
    def moonvit_v2(cls, **overrides: Any) -> ProcessorConfig:
        """K3 preset (our choice): a 65,536-patch budget so 3584×3584 images stay native (256×256 patches,
        16,384 tokens after the 2×2 shuffle)."""
        return replace(cls(max_patches=65536), **overrides)


@dataclass
class ImageBatch:
    """pixel_values [N, 3, p, p] (all images' patches back to back), image_grid_thw [E, 3] int64."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


@dataclass
class VideoBatch:
    """pixel_values_videos [N, 3, p, p], video_grid_thw [V, 3] (one row per volume), volumes per video."""

    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    volumes_per_video: list[int]


# ----------------------------------------------------------------------------------------------- sizes


def navit_size(
    height: int, width: int, config: ProcessorConfig | None = None, max_patches: int | None = None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((H', W'), (H'', W'')): the resized size (step 1) and the padded size (step 2) of an H×W image."""
    if height < 1 or width < 1:
        raise ImageInputError(f"an image must be at least 1×1 pixels, got {height}×{width} (H×W)")
    c = config or ProcessorConfig()
    budget = c.max_patches if max_patches is None else max_patches
    p, side = c.patch_size, c.max_patches_per_side * c.patch_size
    patches = max(1, height // p) * max(1, width // p)
    scale = min(1.0, math.sqrt(budget / patches), side / height, side / width)
    new_h = min(max(1, int(height * scale)), side)
    new_w = min(max(1, int(width * scale)), side)
    unit = c.merge_size * p
    return (new_h, new_w), (-(-new_h // unit) * unit, -(-new_w // unit) * unit)


def num_image_tokens(height: int, width: int, config: ProcessorConfig | VisionConfig | None = None) -> int:
    """Tokens an H×W image gives the language model: (H''/p)·(W''/p) / k² (k×k merge or pixel shuffle)."""
    if isinstance(config, VisionConfig):
        config = ProcessorConfig.from_vision_config(config)
    c = config or ProcessorConfig()
    _, (pad_h, pad_w) = navit_size(height, width, c)
    unit = c.merge_size * c.patch_size
    return (pad_h // unit) * (pad_w // unit)


# ------------------------------------------------------------------------------------------ conversion


def _composite_on_white(rgba: torch.Tensor) -> torch.Tensor:
    """[4, H, W] -> [3, H, W]: rgb·α + (1 − α) on a white background (α in [0, 1]), original dtype."""
    peak = 255.0 if rgba.dtype == torch.uint8 else 1.0
    x = rgba.float() / peak
    rgb = x[:3] * x[3:] + (1 - x[3:])
    rgb = rgb * peak
    return rgb.round().clamp(0, 255).to(rgba.dtype) if rgba.dtype == torch.uint8 else rgb.to(rgba.dtype)


def _shrink(image: Any, size: tuple[int, int]) -> Any:
    """A PIL image at least 4× ``size`` = (H', W') per side, shrunk in PIL to ≥ 2·(H', W'); others as given.

    f = min(⌊H/2H'⌋, ⌊W/2W'⌋): a JPEG not yet loaded is drafted at scale 8, 4 or 2 (≤ f), then the image is
    box-averaged by the remaining f (RGBA premultiplied by PIL; modes ``reduce`` lacks are converted first).
    """
    h, w = size
    if min(image.height // (2 * h), image.width // (2 * w)) < 2:
        return image
    image.draft(None, (2 * w, 2 * h))  # a no-op unless a JPEG not yet loaded
    factor = min(image.height // (2 * h), image.width // (2 * w))
    if factor < 2:
        return image
    if image.mode.startswith("I;16"):
        image = image.convert("I")
    elif image.mode not in ("L", "LA", "RGB", "RGBA", "I") or image.info.get("transparency") is not None:
        alpha = "A" in image.getbands() or image.info.get("transparency") is not None
        image = image.convert("RGBA" if alpha else "RGB")
    return image.reduce(factor)


def _sixteen_to_eight_bit(values: np.ndarray) -> np.ndarray:
    """16-bit values -> uint8: v / 257 rounded, clipped to [0, 255] (65535 -> 255; PIL's convert would clip
    v at 255 instead: white)."""
    return np.clip(np.rint(values.astype(np.float32) / 257.0), 0, 255).astype(np.uint8)


def _pil_to_array(image: Any, size: tuple[int, int] | None = None) -> np.ndarray:
    """PIL image -> [H, W, 3] uint8; 16-bit gray scaled by 1/257, transparency composited onto white.

    With the resize target ``size`` = (H', W'), an image far larger is shrunk in PIL first (``_shrink``).
    """
    from PIL import Image  # lazy: PIL only for PIL-image inputs; arrays and tensors need none

    if size is not None:
        image = _shrink(image, size)
    if image.mode.startswith("I;16") or image.mode == "I":
        image = Image.fromarray(_sixteen_to_eight_bit(np.asarray(image)), "L")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return np.array(image.convert("RGB"))


def to_chw_tensor(image: Any) -> torch.Tensor:
    """PIL image, [H, W, C] / [C, H, W] array or tensor (C ∈ {1, 3, 4}) or [H, W] -> [3, H, W] tensor.

    Channel-first wins when both the first and last dims of an array or tensor could be channels (as in
    transformers); a PIL image's layout is known (an image 1, 3 or 4 pixels tall stays one). Gray is
    repeated to RGB, RGBA composited onto white. 16-bit input (PIL gray, uint16 arrays and tensors) is
    scaled to uint8 by v / 257 rounded; other dtypes are kept (uint8 stays uint8; other integer and float
    values are taken on the 0–255 scale, as transformers rescales every input by 1/255).
    """
    if not isinstance(image, (np.ndarray, torch.Tensor)):
        return _hwc_to_chw(_pil_to_array(image))
    x = _as_tensor(image)
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3:
        raise ImageInputError(f"an image must be [H, W], [H, W, C] or [C, H, W], got shape {tuple(x.shape)}")
    if x.shape[0] not in (1, 3, 4):
        if x.shape[-1] not in (1, 3, 4):
            raise ImageInputError(f"cannot find a channel dim of size 1, 3 or 4 in shape {tuple(x.shape)}")
        x = x.permute(2, 0, 1)
    if x.shape[0] == 1:
        x = x.expand(3, -1, -1)
    elif x.shape[0] == 4:
        x = _composite_on_white(x)
    return x.contiguous()


def _as_tensor(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """An array or tensor as a tensor, uint16 scaled to uint8 (``_sixteen_to_eight_bit``, like 16-bit PIL
    gray); any other tensor as given."""
    if isinstance(image, torch.Tensor):
        if image.dtype != torch.uint16:
            return image
        image = image.cpu().numpy()
    if image.dtype == np.uint16:
        image = _sixteen_to_eight_bit(image)
    return torch.from_numpy(np.ascontiguousarray(image))


def _hwc_to_chw(pixels: np.ndarray) -> torch.Tensor:
    """[H, W, 3] uint8 (``_pil_to_array``) -> [3, H, W], whatever H and W are."""
    return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous()


# ---------------------------------------------------------------------------------------------- steps


def resize_and_pad(frames: torch.Tensor, size: tuple[int, int], padded: tuple[int, int]) -> torch.Tensor:
    """[..., 3, H, W] -> [..., 3, H'', W'']: antialiased bicubic to ``size``, then zeros bottom / right.

    uint8 input is interpolated by PyTorch's native uint8 kernel (what torchvision calls on the CPU); other
    dtypes in fp32 (fp64 kept) without rounding.
    """
    *lead, c, h, w = frames.shape
    x = frames.reshape(-1, c, h, w)
    if (h, w) != size:
        if x.dtype not in (torch.uint8, torch.float32, torch.float64):
            x = x.float()
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    x = F.pad(x, (0, padded[1] - size[1], 0, padded[0] - size[0]))
    return x.reshape(*lead, c, *padded)


def normalize(frames: torch.Tensor, config: ProcessorConfig) -> torch.Tensor:
    """x̂ = (x − 255·μ) / (255·σ) per channel, fp32 (rescale by 1/255 fused into the normalization). [.., 3, H, W]."""
    mean = torch.tensor(config.image_mean, dtype=torch.float32) * 255.0
    std = torch.tensor(config.image_std, dtype=torch.float32) * 255.0
    return (frames.float() - mean[:, None, None]) / std[:, None, None]


def patchify(frames: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[t, 3, H, W] -> [t·h·w, 3, p, p], frame-major then raster order (h = H/p, w = W/p).

    patch[(f·h + i)·w + j] = frames[f, :, i·p:(i+1)·p, j·p:(j+1)·p].
    """
    t, c, height, width = frames.shape
    h, w, p = height // patch_size, width // patch_size, patch_size
    x = frames.reshape(t, c, h, p, w, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(t * h * w, c, p, p)


def _process_volume(
    frames: torch.Tensor, config: ProcessorConfig, budget: int, source: tuple[int, int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """[t, 3, H, W] -> (patches [t·h·w, 3, p, p], grid row [t, h, w]); sizes those of ``source`` (H, W) when
    the frames were already shrunk from it."""
    height, width = source or frames.shape[-2:]
    size, padded = navit_size(height, width, config, max_patches=budget)
    x = normalize(resize_and_pad(frames, size, padded), config)
    p = config.patch_size
    return patchify(x, p), [frames.shape[0], padded[0] // p, padded[1] // p]


# ---------------------------------------------------------------------------------------------- entry


def preprocess_images(images: Any | Sequence[Any], config: ProcessorConfig | None = None) -> ImageBatch:
    """One image or a list of them (PIL / [H, W, 3] uint8 arrays / tensors) -> packed patches + grids."""
    c = config or ProcessorConfig()
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise ValueError("preprocess_images needs at least one image")
    done: dict[int, tuple[torch.Tensor, list[int]]] = {}  # an image given twice is processed once
    for index, im in enumerate(images):
        if id(im) not in done:
            with _naming(f"images[{index}]"):
                done[id(im)] = _image_volume(im, c)
    parts, grids = zip(*(done[id(im)] for im in images), strict=True)
    return ImageBatch(torch.cat(parts), torch.tensor(grids, dtype=torch.long))


@contextmanager
def _naming(what: str) -> Iterator[None]:
    """Prefix an ``ImageInputError`` raised inside with ``what`` (which image or video it is)."""
    try:
        yield
    except ImageInputError as error:
        raise ImageInputError(f"{what}: {error}") from None


def _image_volume(image: Any, config: ProcessorConfig) -> tuple[torch.Tensor, list[int]]:
    """One image -> (patches, grid row); a PIL image shrunk in PIL (``_shrink``) is still sized by its
    original H×W."""
    if isinstance(image, (np.ndarray, torch.Tensor)):
        return _process_volume(to_chw_tensor(image)[None], config, config.max_patches)
    source = (image.height, image.width)
    pixels = _pil_to_array(image, navit_size(*source, config)[0])
    shrunk = source if pixels.shape[:2] != source else None
    return _process_volume(_hwc_to_chw(pixels)[None], config, config.max_patches, shrunk)


def _video_frames(video: Any) -> torch.Tensor:
    """[T, H, W, C] / [T, C, H, W] array or tensor, or a list of frames -> [T, 3, H, W] (T ≥ 1, all frames
    one size)."""
    if not isinstance(video, (list, tuple)):
        video = _as_tensor(video)
        if video.ndim != 4:
            raise ImageInputError(
                f"a video must be [T, H, W, C] or [T, C, H, W], got shape {tuple(video.shape)}"
            )
    frames = []
    for index, frame in enumerate(video):
        with _naming(f"frame {index}"):
            frames.append(to_chw_tensor(frame))
    if not frames:
        raise ImageInputError("a video needs at least one frame, got 0")
    for index, frame in enumerate(frames):
        if frame.shape != frames[0].shape:
            (h0, w0), (h, w) = frames[0].shape[-2:], frame.shape[-2:]
            raise ImageInputError(
                f"frames must be one size: frame 0 is {h0}×{w0} (H×W), frame {index} {h}×{w}"
            )
    return torch.stack(frames)


def _video_volumes(frames: torch.Tensor, config: ProcessorConfig) -> list[tuple[torch.Tensor, list[int]]]:
    """[T, 3, H, W] -> (patches, grid row) per volume of ≤ ``temporal_patch_size`` consecutive frames."""
    vols = video_volumes(frames.shape[0], frames.shape[-2], frames.shape[-1], config.temporal_patch_size)
    starts = np.cumsum([0] + [t for t, _, _ in vols[:-1]])
    return [
        _process_volume(frames[start : start + t], config, config.video_max_patches)
        for start, (t, _, _) in zip(starts.tolist(), vols, strict=True)
    ]


def preprocess_videos(videos: Sequence[Any], config: ProcessorConfig | None = None) -> VideoBatch:
    """Videos of already-sampled frames -> volumes of ≤ ``temporal_patch_size`` frames, packed frame-major."""
    c = config or ProcessorConfig()
    if not videos:
        raise ValueError("preprocess_videos needs at least one video")
    parts, grids, counts = [], [], []
    for index, video in enumerate(videos):
        with _naming(f"videos[{index}]"):
            volumes = _video_volumes(_video_frames(video), c)
        parts += [patches for patches, _ in volumes]
        grids += [grid for _, grid in volumes]
        counts.append(len(volumes))
    return VideoBatch(torch.cat(parts), torch.tensor(grids, dtype=torch.long), counts)
