import pytest
from pydantic import ValidationError

from k2lab.config import ConfigError, ModelConfig, YarnScaling, format_validation_error
from k2lab.presets import available_presets, load_preset


def test_presets_listed():
    assert {"k2", "k2-mini", "k2-nano", "deepseek-v3", "moonlight-16b-a3b"} <= set(available_presets())


def test_k2_preset_matches_public_config():
    c = load_preset("k2")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (7168, 61, 64)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (384, 1, 8)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert c.routed_scaling_factor == 2.827 and c.rope_theta == 50000
    assert c.rope_scaling.factor == 32 and c.rope_scaling.original_max_position_embeddings == 4096
    # facts.md: softmax scale = 192^-0.5 · (0.1·ln 32 + 1)^2 = 0.130861
    assert c.softmax_scale == pytest.approx(0.130861, abs=1e-6)


def test_k2_mini_is_cpu_sized_and_has_every_feature():
    from k2lab.params import count_parameters

    c = load_preset("k2-mini")
    total = count_parameters(c).total
    assert 10e6 <= total <= 40e6
    assert c.n_routed_experts >= 8 and c.num_experts_per_tok == 2 and c.n_shared_experts >= 1
    assert c.q_lora_rank and c.qk_rope_head_dim


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok", "n_routed_experts=8"),
        ({"n_group": 3}, "n_routed_experts", "not divisible by n_group=3"),
        ({"kv_lora_rank": 0}, "kv_lora_rank", "greater than 0"),
        ({"q_lora_rank": -4}, "q_lora_rank", "greater than 0"),
        ({"topk_group": 3}, "topk_group", "n_group=2"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim", "even"),
        ({"bos_token_id": 1000}, "bos_token_id", "outside the vocabulary"),
        ({"first_k_dense_replace": 5}, "first_k_dense_replace", "num_hidden_layers=2"),
    ],
)
def test_invalid_configs_name_the_field_and_reason(overrides, field, reason):
    with pytest.raises(ConfigError) as info:
        load_preset("k2-nano", **overrides)
    assert field in str(info.value) and reason in str(info.value)


def test_unknown_preset_lists_available():
    with pytest.raises(ConfigError, match="available presets: .*k2-mini"):
        load_preset("k9")


def test_unknown_field_rejected():
    data = load_preset("k2-nano").model_dump()
    data["n_experts"] = 3
    with pytest.raises(ValueError, match="n_experts"):
        ModelConfig.model_validate(data)


def test_a_missing_field_is_named_by_the_option_that_sets_it():
    with pytest.raises(ValidationError) as caught:
        YarnScaling.model_validate({"original_max_position_embeddings": 0})
    assert format_validation_error(caught.value) == (
        "factor: Field required; original_max_position_embeddings: Input should be greater than 0"
    )
    named = format_validation_error(caught.value, {"factor": "--factor/-f"})
    assert named.startswith("--factor/-f is required (recipe key factor); original_max")


@pytest.mark.parametrize("theta", [1, 0.5, float("nan"), float("inf")])
def test_rope_theta_must_be_a_finite_number_above_one(theta: float):
    """θ^(−2i/d) needs θ > 1 (θ = 1 divides by ln θ = 0 in YaRN's correction range)."""
    data = load_preset("k2-nano").model_dump()
    with pytest.raises(ValidationError, match="rope_theta"):
        ModelConfig.model_validate({**data, "rope_theta": theta})
