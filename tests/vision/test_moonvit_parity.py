"""MoonViT-3D + projector against transformers' Kimi-K2.5 vision tower on random tiny fp32 configs."""

from __future__ import annotations

import pytest
import torch

from k2lab.vision import (
    MoonViT3D,
    VisionConfig,
    from_hf_vision_names,
    to_hf_vision_names,
    vision_token_counts,
)
from k2lab.vision.moonvit import check_grid, num_parameters, video_volumes

pytest.importorskip("transformers")
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config  # noqa: E402
from transformers.models.kimi_k25.modeling_kimi_k25 import (  # noqa: E402
    Kimi_K25MultimodalProjection,
    Kimi_K25VisionModel,
)

TOL = 1e-4
CONFIGS = {
    "k2x2-gelu-tanh": dict(
        patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, merge_kernel_size=(2, 2),
        text_hidden_size=48,
    ),
    "k2x1-gelu-theta100": dict(
        patch_size=2, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4, num_attention_heads=4,
        num_hidden_layers=3, hidden_size=48, intermediate_size=40, merge_kernel_size=(2, 1),
        hidden_act="gelu", rope_theta=100.0, text_hidden_size=24,
    ),
}  # fmt: skip
# (t, h, w): images of different sizes (smaller than, equal to and larger than the learned grid) and two
# video volumes (4 and 2 frames)
GRID = [[1, 6, 10], [1, 8, 4], [4, 4, 6], [1, 12, 14], [2, 6, 4]]


def hf_pair(config: VisionConfig) -> tuple[Kimi_K25VisionModel, Kimi_K25MultimodalProjection]:
    """transformers' vision tower (eager attention) and projector built from our config."""
    parent = Kimi_K25Config(
        vision_config=config.to_hf(),
        text_config={"model_type": "deepseek_v3", "hidden_size": config.text_hidden_size},
        projection_hidden_size=config.hidden_size,
        projection_layer_norm_eps=config.projection_layer_norm_eps,
    )
    tower = Kimi_K25VisionModel._from_config(parent.vision_config, attn_implementation="eager")
    return tower.eval(), Kimi_K25MultimodalProjection(parent).eval()


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial random weights: unit-ish norm gains, small biases, O(1) position grid."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif p.ndim == 3:  # position grid
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def hf_state(tower: torch.nn.Module, projector: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {"model.vision_tower." + k: v for k, v in tower.state_dict().items()}
    state.update({"model.mm_projector." + k: v for k, v in projector.state_dict().items()})
    return state


def load_hf(tower: torch.nn.Module, projector: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    tower.load_state_dict(
        {k[len("model.vision_tower.") :]: v for k, v in state.items() if "vision_tower" in k}
    )
    projector.load_state_dict(
        {k[len("model.mm_projector.") :]: v for k, v in state.items() if "mm_proj" in k}
    )


def packed_inputs(config: VisionConfig, grid: list[list[int]], seed: int = 1):
    grid_thw = torch.tensor(grid)
    n = int(grid_thw.prod(-1).sum())
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, config.patch_size, config.patch_size, generator=g), grid_thw


def hf_features(tower, projector, pixel_values, grid_thw):
    """What Kimi_K25Model.get_image_features computes: projector(pooled).squeeze(1)."""
    out = tower(pixel_values, grid_thw=grid_thw)
    return out.last_hidden_state, out.pooler_output, projector(out.pooler_output).squeeze(1)


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def config(request) -> VisionConfig:
    return VisionConfig(**CONFIGS[request.param])


def _compare(ours: MoonViT3D, tower, projector, config: VisionConfig) -> dict[str, float]:
    pixel_values, grid_thw = packed_inputs(config, GRID)
    with torch.no_grad():
        mine = ours(pixel_values, grid_thw)
        hidden, pooled, features = hf_features(tower, projector, pixel_values, grid_thw)
    deltas = {
        "last_hidden_state": (mine.last_hidden_state - hidden).abs().max().item(),
        "pooled": (mine.pooled - pooled).abs().max().item(),
        "features": (mine.features - features).abs().max().item(),
    }
    assert mine.features.shape == features.shape
    assert all(d <= TOL for d in deltas.values()), deltas
    print(deltas)
    return deltas


def test_parity_ours_to_hf(config: VisionConfig) -> None:
    ours = MoonViT3D(config).eval()
    randomize(ours, seed=0)
    tower, projector = hf_pair(config)
    load_hf(tower, projector, to_hf_vision_names(ours.state_dict()))
    _compare(ours, tower, projector, config)


def test_parity_hf_to_ours(config: VisionConfig) -> None:
    tower, projector = hf_pair(config)
    randomize(tower, seed=2)
    randomize(projector, seed=3)
    ours = MoonViT3D(config).eval()
    ours.load_state_dict(from_hf_vision_names(hf_state(tower, projector)), strict=True)
    _compare(ours, tower, projector, config)


def test_name_map_is_a_bijection(config: VisionConfig) -> None:
    ours = MoonViT3D(config)
    tower, projector = hf_pair(config)
    theirs = hf_state(tower, projector)
    mapped = to_hf_vision_names(ours.state_dict())
    assert set(mapped) == set(theirs)
    assert all(mapped[k].shape == theirs[k].shape for k in theirs)
    assert set(from_hf_vision_names(mapped)) == set(ours.state_dict())
    assert from_hf_vision_names({"model.language_model.embed_tokens.weight": torch.zeros(1)}) == {}
    assert num_parameters(config) == sum(p.numel() for p in ours.parameters())


def test_attention_confined_to_each_entry() -> None:
    config = VisionConfig(**CONFIGS["k2x2-gelu-tanh"])
    ours = MoonViT3D(config).eval()
    randomize(ours, seed=4)
    pixel_values, grid_thw = packed_inputs(config, GRID)
    lengths = grid_thw.prod(-1).tolist()
    counts = vision_token_counts(grid_thw, config.merge_kernel_size)
    perturbed = pixel_values.clone()
    start = lengths[0]
    perturbed[start : start + lengths[1]] += torch.randn(lengths[1], 3, 4, 4)
    with torch.no_grad():
        a, b = ours(pixel_values, grid_thw), ours(perturbed, grid_thw)
    split = lambda x, sizes: x.split(sizes)  # noqa: E731
    h_a, h_b = split(a.last_hidden_state, lengths), split(b.last_hidden_state, lengths)
    f_a, f_b = split(a.features, counts), split(b.features, counts)
    for e in (0, 2, 3, 4):  # every other entry: unchanged
        assert (h_a[e] - h_b[e]).abs().max().item() <= 1e-6
        assert (f_a[e] - f_b[e]).abs().max().item() <= 1e-6
    assert (f_a[1] - f_b[1]).abs().max().item() > 1e-3  # the perturbed one did change


def test_volume_frames_attend_to_each_other() -> None:
    """Within a video volume the frames share one attention segment: changing frame 3 moves frame 0."""
    config = VisionConfig(**CONFIGS["k2x2-gelu-tanh"])
    ours = MoonViT3D(config).eval()
    randomize(ours, seed=5)
    pixel_values, grid_thw = packed_inputs(config, [[4, 4, 6]])
    perturbed = pixel_values.clone()
    perturbed[3 * 24 :] += 1.0
    with torch.no_grad():
        a, b = ours.encoder(pixel_values, grid_thw), ours.encoder(perturbed, grid_thw)
    assert (a[:24] - b[:24]).abs().max().item() > 1e-3


@pytest.mark.parametrize("kernel", [(2, 2), (2, 1), (1, 3)])
def test_token_counts(kernel: tuple[int, int]) -> None:
    kh, kw = kernel
    grids = [[1, 2 * kh, 3 * kw], [4, 5 * kh, 1 * kw], [2, 1 * kh, 7 * kw], [1, 6 * kh, 6 * kw]]
    expected = [(h // kh) * (w // kw) for _, h, w in grids]  # t frames pooled into one
    assert vision_token_counts(torch.tensor(grids), kernel) == expected
    # a 4-frame volume gives 4x fewer tokens than its frames encoded as 4 images
    assert vision_token_counts(torch.tensor([[4, 2 * kh, 2 * kw]]), kernel) == [4]
    assert sum(vision_token_counts(torch.tensor([[1, 2 * kh, 2 * kw]] * 4), kernel)) == 16

    config = VisionConfig(
        **{**CONFIGS["k2x2-gelu-tanh"], "merge_kernel_size": kernel, "num_hidden_layers": 1}
    )
    ours = MoonViT3D(config).eval()
    pixel_values, grid_thw = packed_inputs(config, grids)
    with torch.no_grad():
        out = ours(pixel_values, grid_thw)
    assert out.counts == expected
    assert out.pooled.shape == (sum(expected), kh * kw, config.hidden_size)
    assert out.features.shape == (sum(expected), config.text_hidden_size)


def test_video_volumes() -> None:
    assert video_volumes(10, 4, 6) == [(4, 4, 6), (4, 4, 6), (2, 4, 6)]
    assert video_volumes(4, 2, 2) == [(4, 2, 2)]


def test_bad_inputs_and_configs() -> None:
    config = VisionConfig(**CONFIGS["k2x2-gelu-tanh"])
    with pytest.raises(ValueError, match="pos_emb_time"):
        check_grid(torch.tensor([[5, 2, 2]]), 20, config)
    with pytest.raises(ValueError, match="merge_kernel_size"):
        check_grid(torch.tensor([[1, 3, 2]]), 6, config)
    with pytest.raises(ValueError, match="pixel_values has 7"):
        check_grid(torch.tensor([[1, 2, 2]]), 7, config)
    with pytest.raises(ValueError, match="num_attention_heads"):
        VisionConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="divisible by 4"):
        VisionConfig(hidden_size=12, num_attention_heads=2)
    with pytest.raises(ValueError, match="square"):
        VisionConfig(pos_emb_height=8, pos_emb_width=6)


def test_config_round_trip_through_hf() -> None:
    config = VisionConfig(**CONFIGS["k2x1-gelu-theta100"])
    parent = {
        "projection_hidden_size": config.hidden_size,
        "projection_layer_norm_eps": config.projection_layer_norm_eps,
        "text_config": {"hidden_size": config.text_hidden_size},
    }
    assert VisionConfig.from_hf(config.to_hf(), parent) == config
