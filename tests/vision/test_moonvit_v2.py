"""MoonViT-V2 (Kimi K3 as released): RMSNorm, bias-free, q/k/v wider than the tower, 2×2 pixel shuffle and
the post-norm projector — token counts, structure, size, packing, and that a tiny one trains from scratch."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from k2lab.nn.norm import RMSNorm
from k2lab.params import count_parameters
from k2lab.presets import load_preset
from k2lab.presets.vision_language import load_vlm_preset, vlm_parameter_counts
from k2lab.vision import MoonViT3D, VisionConfig, num_parameters, pixel_shuffle, vision_token_counts
from k2lab.vision.moonvit import temporal_merge

TINY = dict(
    patch_size=4, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=2,
    hidden_size=32, qkv_hidden_size=48, intermediate_size=64, text_hidden_size=24,
)  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is ~10× faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_v2(**overrides) -> VisionConfig:
    return VisionConfig.moonvit_v2(**{**TINY, **overrides})


def full_size(config: VisionConfig) -> MoonViT3D:
    with torch.device("meta"):
        return MoonViT3D(config)


@pytest.mark.parametrize(
    ("pixels", "frames", "tokens"),
    [
        ((224, 224), 1, 64),  # 16×16 patches
        ((3584, 3584), 1, 16384),  # 256×256 patches
        ((448, 896), 1, 512),  # 32×64
        ((336, 112), 1, 48),  # 24×8, tall
        ((224, 224), 4, 64),  # a 4-frame volume: as many tokens as one frame
        ((224, 448), 3, 128),
    ],
)
def test_token_counts(pixels: tuple[int, int], frames: int, tokens: int) -> None:
    config = VisionConfig.moonvit_v2()
    h, w = (s // config.patch_size for s in pixels)
    assert vision_token_counts(torch.tensor([[frames, h, w]]), config.merge_kernel_size) == [tokens]


def test_tiny_forward_shapes() -> None:
    config = tiny_v2()
    grid = torch.tensor([[1, 4, 6], [4, 2, 2], [1, 8, 8], [3, 6, 2]])
    pixel_values = torch.randn(int(grid.prod(-1).sum()), 3, 4, 4)
    with torch.no_grad():
        out = MoonViT3D(config)(pixel_values, grid)
    assert out.counts == [6, 1, 16, 3]
    assert out.features.shape == (26, config.text_hidden_size)
    assert out.pooled.shape == (26, 4, config.hidden_size)


def test_no_bias_no_layernorm() -> None:
    v2 = full_size(VisionConfig.moonvit_v2())
    assert not [n for n, _ in v2.named_parameters() if n.endswith("bias")]
    assert not [m for m in v2.modules() if isinstance(m, nn.LayerNorm)]
    norms = [m for m in v2.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * 27 + 1 + 1  # two per block, final, projector
    assert all(norm.eps == 2.0**-23 for norm in norms[:-1])  # nn.RMSNorm's default: fp32 machine epsilon
    assert v2.projector.post_norm.eps == 1e-5  # projector_ln_eps
    assert v2.projector.post_norm.weight.shape == (7168,)  # patchmergerv2 norms its D_text-wide output
    assert not hasattr(v2.projector, "norm")
    attn = v2.encoder.blocks[0].attn
    assert attn.q.weight.shape == (1536, 1024) and attn.o.weight.shape == (1024, 1536)  # 12 heads × 128
    k25 = full_size(VisionConfig.moonvit_3d())
    assert not [m for m in k25.modules() if isinstance(m, RMSNorm)]
    assert k25.projector.norm.weight.shape == (1152,)


def test_parameter_count() -> None:
    for config in (
        VisionConfig.moonvit_v2(),
        VisionConfig.moonvit_3d(),
        tiny_v2(),
        tiny_v2(norm="layernorm"),
    ):
        model = full_size(config)
        assert num_parameters(config) == sum(p.numel() for p in model.parameters())
        tower = sum(p.numel() for p in model.encoder.parameters())
        assert num_parameters(config, include_projector=False) == tower
    tower = num_parameters(VisionConfig.moonvit_v2(), include_projector=False)
    # patch 3·14²·1024 + grid 64·64·1024 + 27 · (q, k, v 3·1024·1536 + wo 1536·1024 + MLP 2·1024·4096
    # + 2 norms 2·1024) + final norm 1024: the released tower, the report's "401M-parameter MoonViT-V2"
    assert tower == 602_112 + 4_194_304 + 27 * (4_718_592 + 1_572_864 + 8_388_608 + 2_048) + 1_024
    assert tower == 401_214_464


def test_presets_and_hf_export() -> None:
    assert VisionConfig.moonvit_3d() == VisionConfig()
    v2 = VisionConfig.moonvit_v2()
    assert (v2.num_hidden_layers, v2.merge_kernel_size, v2.norm, v2.bias, v2.merge) == (
        27, (2, 2), "rmsnorm", False, "pixel_shuffle",
    )  # fmt: skip
    assert (v2.hidden_size, v2.num_attention_heads, v2.head_dim, v2.intermediate_size) == (
        1024,
        12,
        128,
        4096,
    )
    assert v2.pos_emb_interpolation == "bilinear"
    assert VisionConfig.moonvit_v2(hidden_size=64, num_attention_heads=4).hidden_size == 64
    hf = VisionConfig.moonvit_3d().to_hf()
    assert not {"norm", "bias", "merge"} & set(hf)
    for config in (
        v2,
        VisionConfig(norm="rmsnorm"),
        VisionConfig(bias=False),
        VisionConfig(merge="pixel_shuffle"),
        VisionConfig(qkv_hidden_size=1536),
        VisionConfig(pos_emb_interpolation="bilinear"),
    ):
        with pytest.raises(ValueError, match="kimi_k25 has only the K2.5"):
            config.to_hf()
    assert (
        VisionConfig.from_hf({**hf, "bias": False}) == VisionConfig()
    )  # variant switches never come from HF


def test_pixel_shuffle_layout() -> None:
    t, h, w, d = 2, 4, 6, 3
    x = torch.randn(t, h, w, d)
    y = pixel_shuffle(x)
    assert y.shape == (t, 2, 3, 4 * d)
    for a in range(2):
        for b in range(2):  # channel block (a·2 + b) holds the patch at row offset a, column offset b
            assert torch.equal(y[..., (a * 2 + b) * d : (a * 2 + b + 1) * d], x[:, a::2, b::2])
    grid = torch.tensor([[t, h, w]])
    merged = temporal_merge(x.reshape(-1, d), grid, (2, 2))
    torch.testing.assert_close(merged.flatten(1), y.mean(0).reshape(-1, 4 * d))
    with pytest.raises(ValueError, match="not divisible"):
        pixel_shuffle(torch.randn(3, 4, 2))


def test_packing_equivalence() -> None:
    torch.manual_seed(0)
    config = tiny_v2()
    model = MoonViT3D(config).eval()
    model.reset_parameters(std=0.1)
    grids = [[1, 6, 4], [1, 2, 8], [4, 4, 4], [1, 10, 10]]
    entries = [torch.randn(t * h * w, 3, 4, 4) for t, h, w in grids]
    with torch.no_grad():
        packed = model(torch.cat(entries), torch.tensor(grids))
        alone = [model(x, torch.tensor([g])).features for x, g in zip(entries, grids, strict=True)]
    assert (packed.features - torch.cat(alone)).abs().max().item() <= 1e-5


def colour_batch(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n noisy 16×16 images (4×4 patches of 4 px), each tinted towards one of 3 colours; label = colour."""
    labels = torch.randint(0, 3, (n,), generator=g)
    images = 0.6 * torch.randn(n, 3, 16, 16, generator=g)
    images[torch.arange(n), labels] += 0.5
    patches = images.view(n, 3, 4, 4, 4, 4).permute(0, 2, 4, 1, 3, 5).reshape(n * 16, 3, 4, 4)
    return patches, torch.tensor([[1, 4, 4]] * n), labels


def test_trains_from_scratch() -> None:
    """Tiny V2 + a linear head on the mean vision token classifies the tint: loss falls ≥ 5× in 60 steps."""
    torch.manual_seed(0)
    config = tiny_v2(text_hidden_size=16)
    tower = MoonViT3D(config)
    tower.reset_parameters()
    head = nn.Linear(config.text_hidden_size, 3)
    params = [*tower.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses, start = [], time.perf_counter()
    for _ in range(60):
        pixel_values, grid, labels = colour_batch(32, g)
        out = tower(pixel_values, grid)
        logits = head(out.features.view(32, -1, config.text_hidden_size).mean(1))
        loss = nn.functional.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first / 5, (first, last)
    assert elapsed < 10, elapsed


def test_k3_vl_preset_full_size() -> None:
    """``k3-vl`` = the k3 decoder + the released tower, built on the meta device; counts derived by hand."""
    config = load_vlm_preset("k3-vl")
    assert config.vision == VisionConfig.moonvit_v2(text_hidden_size=7168)
    assert config.text == load_preset("k3") and config.image_token_id == 163605  # media_placeholder_token_id
    d, a, f, k, t = 1024, 1536, 4096, 4, 7168
    tower = 3 * 14 * 14 * d + 64 * 64 * d + 27 * (3 * a * d + d * a + 2 * d * f + 2 * d) + d
    projector = (k * d) * (k * d) + t * (k * d) + t  # proj.0, proj.2, post_norm
    assert (tower, projector) == (401_214_464, 46_144_512)
    counts = vlm_parameter_counts(config)  # the VLM built on the meta device, its modules counted
    text = count_parameters(config.text).total  # the decoder as ``k2lab params`` counts it
    assert counts == {
        "language_model": text,
        "vision_tower": tower,
        "projector": projector,
        "total": text + tower + projector,
    }


def test_attention_width_and_bilinear_positions() -> None:
    config = tiny_v2()
    assert (config.attention_width, config.head_dim) == (48, 24)
    with pytest.raises(ValueError, match="qkv_hidden_size=49 must be divisible by num_attention_heads=2"):
        tiny_v2(qkv_hidden_size=49)
    with pytest.raises(ValueError, match="head dim 10 must be divisible by 4"):
        tiny_v2(qkv_hidden_size=20)
    # bilinear 2 -> 4, align_corners=False: output centres at -0.25, 0.25, 0.75, 1.25 (clamped): P0, ¾P0 + ¼P1, ...
    pos = MoonViT3D(tiny_v2(pos_emb_height=2, pos_emb_width=2)).encoder.pos_embed
    with torch.no_grad():
        pos.weight.copy_(torch.tensor([[0.0, 4.0], [8.0, 12.0]])[..., None].expand(2, 2, 32))
        row = pos.resample(4, 4)[:4, 0]  # first output row (= input row 0): 0, 1, 3, 4
    assert row.tolist() == [0.0, 1.0, 3.0, 4.0]


@pytest.mark.parametrize("tower", ["moonvit_3d", "moonvit_v2"])
def test_pixel_values_must_be_patches_of_the_towers_size(tower: str) -> None:
    """Both towers refuse pixel_values whose trailing shape is not [3, p, p] (a stride-p convolution would
    silently crop larger patches and fail with a raw size error on smaller ones)."""
    config = getattr(VisionConfig, tower)(**TINY)
    model = MoonViT3D(config)
    grid = torch.tensor([[1, 2, 2]])
    with torch.no_grad():
        assert model(torch.randn(4, 3, 4, 4), grid).features.shape[0] == 1
        for shape in [(4, 3, 6, 6), (4, 3, 2, 2), (4, 1, 4, 4), (4, 3, 4, 8), (4, 48)]:
            with pytest.raises(ValueError, match=r"pixel_values must be \[N, 3, 4, 4\] patches"):
                model(torch.randn(*shape), grid)
