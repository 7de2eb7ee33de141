"""Native-resolution preprocessing against transformers' Kimi-K2.5 image / video processors.

transformers' processors need torchvision, which the project's venv does not carry (PyPI's CPU-less
torchvision does not import beside torch's CPU wheel), so the direct comparisons skip without it. The
golden statistics below were produced by those reference processors (transformers 5.24, torchvision 0.28)
on the same synthetic inputs, so the comparison still runs everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from k2lab.vision import MoonViT3D, VisionConfig
from k2lab.vision.processor import (
    ProcessorConfig,
    navit_size,
    num_image_tokens,
    patchify,
    preprocess_images,
    preprocess_videos,
)

SIZES = [(1, 1), (5, 9), (13, 29), (37, 41), (300, 17), (17, 300), (224, 224), (640, 480), (7200, 100)]
LARGE = [(2000, 3000), (1800, 1800)]  # above the 16,384-patch budget

# (size, grid_thw row, Σx, Σ|x|, Σx²) of the reference's pixel_values on synthetic(h, w)
GOLDEN = [
    ((5, 9), [1, 2, 2], -2215.482353, 2284.713727, 2262.683093),
    ((37, 41), [1, 4, 4], -4839.560783, 7144.109849, 6390.764342),
    ((300, 17), [1, 22, 2], -10591.670587, 18254.400150, 15709.724494),
    ((640, 480), [1, 46, 36], -52051.866665, 514741.977676, 361749.302602),
    ((2000, 3000), [1, 106, 158], -150231.349005, 2867849.922408, 1294216.143531),
]
GOLDEN_VIDEO = ([[4, 18, 28], [2, 18, 28]], -113113.396074, 948869.130075, 672458.636544)


def synthetic(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A deterministic, high-frequency [h, w, 3] uint8 image (no RNG: identical on every platform)."""
    i, j, c = np.arange(h)[:, None, None], np.arange(w)[None, :, None], np.arange(3)
    return ((i * 37 + j * 91 + c * 53 + (i * j) % 17 * 11 + seed * 29) % 256).astype(np.uint8)


def synthetic_video(frames: int = 6, h: int = 250, w: int = 370) -> np.ndarray:
    return np.stack([synthetic(h, w, seed=s) for s in range(frames)])


def _stats(x: torch.Tensor) -> tuple[float, float, float]:
    x = x.double()
    return x.sum().item(), x.abs().sum().item(), (x * x).sum().item()


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("torchvision", reason="transformers' Kimi-K2.5 processors need torchvision")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    return Kimi_K25ImageProcessor(), Kimi_K25VideoProcessor()


@pytest.mark.parametrize("size", SIZES + LARGE, ids=[f"{h}x{w}" for h, w in SIZES + LARGE])
def test_images_match_transformers(reference, size: tuple[int, int]) -> None:
    image = np.random.default_rng(size[0] * 7 + size[1]).integers(0, 256, (*size, 3), dtype=np.uint8)
    ref = reference[0](image, return_tensors="pt")
    ours = preprocess_images(image)
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    assert ours.pixel_values.shape == ref["pixel_values"].shape
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6


def test_image_list_and_pil_match_transformers(reference) -> None:
    images = [synthetic(50, 60), synthetic(100, 33), synthetic(50, 60, seed=1)]
    ref = reference[0](images, return_tensors="pt")
    ours = preprocess_images(images)
    assert torch.equal(ours.image_grid_thw, ref["image_grid_thw"])
    assert (ours.pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6
    rgba = Image.fromarray(synthetic(40, 70)).convert("RGBA")
    rgba.putalpha(Image.fromarray(synthetic(40, 70)[..., 0]))
    ref = reference[0](rgba, return_tensors="pt")
    assert (preprocess_images(rgba).pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6


def test_videos_match_transformers(reference) -> None:
    videos = [synthetic_video(), synthetic_video(3, 50, 70)]
    ref = reference[1](videos=videos, do_sample_frames=False, return_tensors="pt")
    ours = preprocess_videos(videos)
    assert torch.equal(ours.video_grid_thw, ref["video_grid_thw"])
    assert ours.volumes_per_video == ref["num_chunks_per_video"].tolist()
    assert (ours.pixel_values_videos - ref["pixel_values_videos"]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("golden", GOLDEN, ids=[f"{g[0][0]}x{g[0][1]}" for g in GOLDEN])
def test_images_match_recorded_reference(golden) -> None:
    (h, w), grid, *stats = golden
    ours = preprocess_images(synthetic(h, w))
    assert ours.image_grid_thw.tolist() == [grid]
    assert _stats(ours.pixel_values) == pytest.approx(stats, abs=1e-3, rel=0)


def test_video_matches_recorded_reference() -> None:
    grids, *stats = GOLDEN_VIDEO
    ours = preprocess_videos([synthetic_video()])
    assert ours.video_grid_thw.tolist() == grids
    assert _stats(ours.pixel_values_videos) == pytest.approx(stats, abs=1e-3, rel=0)


def test_navit_size_and_token_counts() -> None:
    assert navit_size(224, 224) == ((224, 224), (224, 224))
    assert navit_size(13, 29) == ((13, 29), (28, 56))  # never upscaled, padded to multiples of 28
    (h, w), (ph, pw) = navit_size(3584, 3584)  # 65,536 patches > 16,384: scaled by 1/2
    assert (h, w) == (1792, 1792) and (ph // 14) * (pw // 14) <= 16384
    assert navit_size(7200, 100)[0] == (7168, 99)  # 512 patches per side at most
    assert num_image_tokens(224, 224) == 64
    assert num_image_tokens(3584, 3584) == 4096
    v2 = ProcessorConfig.moonvit_v2()
    assert num_image_tokens(3584, 3584, v2) == 16384  # native 256×256 patches, 2×2 shuffle
    assert num_image_tokens(3584, 3584, VisionConfig.moonvit_v2()) == 16384
    assert num_image_tokens(3584, 3584, VisionConfig.moonvit_3d()) == 4096
    for h, w in SIZES:
        grid = preprocess_images(synthetic(h, w)).image_grid_thw[0]
        assert num_image_tokens(h, w) == int(grid[1] * grid[2]) // 4


def test_patch_layout_and_padding() -> None:
    frames = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).view(2, 3, 4, 6)
    patches = patchify(frames, 2)  # h = 2, w = 3
    assert patches.shape == (12, 3, 2, 2)
    assert torch.equal(patches[1 * 6 + 1 * 3 + 2], frames[1, :, 2:4, 4:6])  # frame 1, row 1, col 2
    out = preprocess_images(np.full((20, 20, 3), 255, np.uint8))  # padded to 28×28 with zeros
    image = out.pixel_values.view(2, 2, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 28, 28)
    assert torch.all(image[:, :20, :20] == 1) and torch.all(image[:, 20:] == -1)


def test_input_kinds_agree() -> None:
    rgb = synthetic(45, 61)
    expected = preprocess_images(rgb).pixel_values
    for image in (Image.fromarray(rgb), torch.from_numpy(rgb), torch.from_numpy(rgb).permute(2, 0, 1)):
        assert torch.equal(preprocess_images(image).pixel_values, expected)
    gray = rgb[..., 0]
    assert torch.equal(
        preprocess_images(gray).pixel_values,
        preprocess_images(np.repeat(gray[..., None], 3, -1)).pixel_values,
    )
    video = synthetic_video(5, 30, 40)
    as_frames = [Image.fromarray(f) for f in video]
    assert torch.equal(
        preprocess_videos([as_frames]).pixel_values_videos, preprocess_videos([video]).pixel_values_videos
    )


def test_feeds_the_tower() -> None:
    config = VisionConfig(
        patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=1,
        hidden_size=16, intermediate_size=32, text_hidden_size=8,
    )  # fmt: skip
    images = preprocess_images([synthetic(60, 90), synthetic(30, 30)])
    videos = preprocess_videos([synthetic_video(5, 40, 40)])
    with torch.no_grad():
        out = MoonViT3D(config)(images.pixel_values, images.image_grid_thw)
        vid = MoonViT3D(config)(videos.pixel_values_videos, videos.video_grid_thw)
    assert out.counts == [num_image_tokens(60, 90), num_image_tokens(30, 30)]
    assert vid.counts == [4, 4]  # two volumes (4 + 1 frames), 4×4 patches -> 2×2 tokens each


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I"])
def test_sixteen_bit_gray_is_scaled_to_eight_bits(mode) -> None:
    """v / 257 rounded (40000 -> 156), not PIL's clipping convert (-> 255, white)."""
    values = np.full((40, 40), 40000, np.uint16)
    image = Image.fromarray(values) if mode == "I;16" else Image.fromarray(values.astype(np.int32))
    if mode == "I;16B":
        image = image.convert("I;16B")
    assert image.mode == mode
    expected = preprocess_images(np.full((40, 40, 3), 156, np.uint8)).pixel_values
    assert torch.equal(preprocess_images(image).pixel_values, expected)


def _smooth(h: int, w: int) -> np.ndarray:
    """A smooth [h, w, 3] uint8 gradient (shrinking it by averaging first changes little)."""
    i, j = np.linspace(0, 1, h)[:, None, None], np.linspace(0, 1, w)[None, :, None]
    return (255 * (0.6 * i + 0.4 * j) * np.array([1.0, 0.7, 0.4])).round().astype(np.uint8)


def test_far_larger_pil_images_are_shrunk_in_pil_first(monkeypatch) -> None:
    """An image ≥ 4× its target per side reaches the arrays at ≥ 2× (not full size), with the grid of its
    original size and nearly the pixels of the full-size path; one within 4× takes the full-size path
    bit for bit; a transparent one still lands on white."""
    import k2lab.vision.processor as processor

    config = ProcessorConfig(max_patches=64)  # target 112×112 for a square image
    seen = []
    to_chw = processor._hwc_to_chw
    monkeypatch.setattr(
        processor, "_hwc_to_chw", lambda pixels: seen.append(pixels.shape[:2]) or to_chw(pixels)
    )
    rgb = _smooth(1000, 1000)
    ours = preprocess_images(Image.fromarray(rgb), config)
    assert seen == [(250, 250)]  # reduced by ⌊1000 / 224⌋ = 4
    full = preprocess_images(rgb, config)  # the array path: no shrinking
    assert torch.equal(ours.image_grid_thw, full.image_grid_thw)
    assert (ours.pixel_values - full.pixel_values).abs().max().item() <= 2 / 255 + 1e-6  # ≤ 1 level
    within = _smooth(400, 430)  # < 4× the target per side: unchanged path
    assert torch.equal(
        preprocess_images(Image.fromarray(within), config).pixel_values,
        preprocess_images(within, config).pixel_values,
    )
    clear = preprocess_images(Image.new("RGBA", (1000, 1000), (0, 0, 0, 0)), config).pixel_values
    assert torch.all(clear == 1)


def test_a_large_jpeg_is_decoded_at_reduced_scale(tmp_path) -> None:
    """A JPEG not yet loaded is drafted (1/4 scale here); the grid is its original size's, and the same
    image given twice is processed once."""
    config = ProcessorConfig(max_patches=64)
    path = tmp_path / "large.jpg"
    Image.fromarray(_smooth(1000, 1000)).save(path, quality=95)
    with Image.open(path) as image:
        ours = preprocess_images([image, image], config)
        assert image.size == (250, 250)  # drafted in place
    full = preprocess_images(_smooth(1000, 1000), config)
    assert ours.image_grid_thw.tolist() == full.image_grid_thw.tolist() * 2
    half = ours.pixel_values.shape[0] // 2
    assert torch.equal(ours.pixel_values[:half], ours.pixel_values[half:])
    assert (ours.pixel_values[:half] - full.pixel_values).abs().max().item() <= 0.05  # JPEG's own loss


@pytest.mark.parametrize("height", [1, 3, 4])
def test_a_pil_image_a_few_pixels_tall_is_not_read_channel_first(height: int) -> None:
    """[H, W, 3] with H ∈ {1, 3, 4} is ambiguous as an array, never as a PIL image."""
    pixels = synthetic(height, 10)
    ours = preprocess_images(Image.fromarray(pixels))
    chw = preprocess_images(torch.from_numpy(pixels).permute(2, 0, 1).contiguous())
    assert torch.equal(ours.image_grid_thw, chw.image_grid_thw) and torch.equal(
        ours.pixel_values, chw.pixel_values
    )


@pytest.mark.parametrize("kind", ["array", "tensor", "video"])
def test_uint16_arrays_are_scaled_like_sixteen_bit_pil(kind: str) -> None:
    """A uint16 array / tensor is v / 257 rounded, as a 16-bit (I;16) PIL image of the same values
    (65535 -> 255 -> +1, not 65535 / 127.5 − 1 ≈ 513)."""
    values = np.random.default_rng(0).integers(0, 65536, (30, 31), dtype=np.uint16)
    values[0, :3] = [0, 65535, 40000]
    expected = preprocess_images(Image.fromarray(values)).pixel_values
    if kind == "video":
        video = np.repeat(np.stack([values, values])[..., None], 3, -1)
        ours = preprocess_videos([video]).pixel_values_videos
        expected = preprocess_videos([[Image.fromarray(values)] * 2]).pixel_values_videos
    else:
        ours = preprocess_images(values if kind == "array" else torch.from_numpy(values)).pixel_values
    assert torch.equal(ours, expected)
    assert ours.min().item() == -1 and ours.max().item() == 1


def test_float_arrays_are_on_the_0_255_scale() -> None:
    """Float (and wider-integer) arrays are taken as 0–255 values, like transformers' rescale by 1/255."""
    rgb = synthetic(20, 30)
    expected = preprocess_images(rgb).pixel_values
    assert torch.equal(preprocess_images(rgb.astype(np.float32)).pixel_values, expected)
    assert torch.equal(preprocess_images(rgb.astype(np.int32)).pixel_values, expected)


BAD_IMAGES = [
    ("empty array", lambda: [np.zeros((0, 0, 3), np.uint8)], r"images\[0\]: .*at least 1×1 pixels, got 0×0"),
    ("empty PIL", lambda: [synthetic(5, 5), Image.new("RGB", (0, 0))], r"images\[1\]: .*got 0×0"),
    ("zero-height", lambda: [synthetic(5, 5), np.zeros((0, 7), np.uint8)], r"images\[1\]: .*got 0×7"),
    ("no channels", lambda: [np.zeros((5, 6, 7), np.uint8)], r"images\[0\]: cannot find a channel dim"),
]  # fmt: skip
BAD_VIDEOS = [
    ("no frames", lambda: [np.zeros((0, 40, 60, 3), np.uint8)], r"videos\[0\]: .*at least one frame"),
    ("empty frames", lambda: [synthetic_video(1, 8, 8), np.zeros((2, 0, 5, 3), np.uint8)], r"videos\[1\]: .*0×5"),
    ("empty list", lambda: [[]], r"videos\[0\]: .*at least one frame"),
    ("sizes", lambda: [[synthetic(40, 60), synthetic(40, 60), synthetic(30, 60)]], r"frame 0 is 40×60 \(H×W\), frame 2 30×60"),
    ("bad frame", lambda: [[synthetic(4, 6), np.zeros((4, 6, 3, 2), np.uint8)]], r"videos\[0\]: frame 1: an image must be"),
    ("3-D", lambda: [np.zeros((3, 40, 60), np.uint8)], r"videos\[0\]: a video must be \[T, H, W, C\]"),
]  # fmt: skip


@pytest.mark.parametrize("name,images,message", BAD_IMAGES, ids=[b[0] for b in BAD_IMAGES])
def test_bad_images_raise_a_clear_error_naming_the_image(name, images, message) -> None:
    from k2lab.errors import K2LabError

    with pytest.raises(K2LabError, match=message) as error:
        preprocess_images(images())
    assert isinstance(error.value, ValueError)  # the module's errors stay ValueErrors


@pytest.mark.parametrize("name,videos,message", BAD_VIDEOS, ids=[b[0] for b in BAD_VIDEOS])
def test_bad_videos_raise_a_clear_error_naming_the_video(name, videos, message) -> None:
    from k2lab.errors import K2LabError

    with pytest.raises(K2LabError, match=message):
        preprocess_videos(videos())


@pytest.mark.parametrize("size", [(-1, 5), (0, 5), (5, 0)])
def test_token_counts_refuse_empty_sizes(size: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="at least 1×1 pixels"):
        num_image_tokens(*size)
