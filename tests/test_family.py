"""One test of K3-only features decides both the checkpoint format and the chat format: a model with only a
full-rank KDA output gate is a kimi_k3 checkpoint that speaks K3; a K3 setting on layers the model does not
have (a lower-bounded KDA gate, a gated MLA output without MLA layers) makes neither."""

from __future__ import annotations

import pytest

from k2lab import load_preset
from k2lab.family import is_k3_family, k3_features
from k2lab.hf import kimi_linear
from k2lab.hf.formats import checkpoint_model_type
from k2lab.runtime.chat_format import chat_format_for


@pytest.mark.parametrize(
    ("preset", "overrides", "family"),
    [
        ("kimi-linear-48b-a3b", {"kda_output_gate": "full_rank"}, "k3"),
        ("kimi-linear-48b-a3b", {"kda_gate": "lower_bound"}, "k3"),
        ("kimi-linear-48b-a3b", {}, "k2"),
        ("k2-nano", {"kda_gate": "lower_bound", "kda_output_gate": "full_rank"}, "k2"),  # no KDA layers
        ("k2-nano", {"mla_output_gate": True}, "k3"),
        ("k3-nano", {}, "k3"),
    ],
)
def test_one_feature_test_decides_checkpoint_and_chat_format(preset, overrides, family):
    config = load_preset(preset, **overrides)
    assert kimi_linear.k3_features is k3_features
    assert is_k3_family(config) == (family == "k3") == (checkpoint_model_type(config) == "kimi_k3")
    assert chat_format_for(config).family == family
