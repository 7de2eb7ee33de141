import math

import pytest
import torch

from k2lab.nn.rope import apply_rotary, yarn_inverse_frequencies
from k2lab.presets import load_preset


def test_k2_yarn_keeps_pairs_0_to_19_and_divides_20_to_31_by_32():
    c = load_preset("k2")
    inv_freq, attention_factor = yarn_inverse_frequencies(64, c.rope_theta, c.rope_scaling)
    plain = 1.0 / c.rope_theta ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    torch.testing.assert_close(inv_freq[:20], plain[:20])
    torch.testing.assert_close(inv_freq[20:], plain[20:] / 32)
    assert attention_factor == 1.0  # mscale == mscale_all_dim: the temperature sits in the softmax scale


@pytest.mark.parametrize("preset", ["k2", "deepseek-v3", "k2-nano"])
def test_yarn_matches_transformers(preset):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from k2lab.hf.mapping import config_to_hf

    c = load_preset(preset)
    data = {k: v for k, v in config_to_hf(c).items() if k != "architectures"}
    reference = transformers.DeepseekV3Config(**data)
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](reference, "cpu")
    inv, factor = yarn_inverse_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
    torch.testing.assert_close(inv, ref_inv)
    assert factor == pytest.approx(ref_factor)


def test_rotation_preserves_norm_and_relative_positions():
    torch.manual_seed(0)
    inv, _ = yarn_inverse_frequencies(8, 10000.0, None)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def rotate(x, pos):
        angles = torch.tensor([[float(pos)]])[..., None] * inv
        return apply_rotary(x, angles.cos(), angles.sin())

    assert rotate(q, 7).norm() == pytest.approx(q.norm().item(), rel=1e-6)
    # q_m · k_n depends only on m − n
    a = (rotate(q, 10) * rotate(k, 3)).sum()
    b = (rotate(q, 107) * rotate(k, 100)).sum()
    assert a.item() == pytest.approx(b.item(), abs=1e-5)
    # hand-derived first pair: (x0, x1) rotated by pos·θ_0 = pos radians
    x = torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]).view(1, 1, 1, 8)
    out = rotate(x, 1)
    # de-interleaved output: rotated evens first, then rotated odds
    assert out[0, 0, 0, 0].item() == pytest.approx(math.cos(1.0), abs=1e-6)
    assert out[0, 0, 0, 4].item() == pytest.approx(math.sin(1.0), abs=1e-6)
