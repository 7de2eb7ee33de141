import json
import subprocess
import sys

import pytest

from k2lab.params import count_parameters
from k2lab.presets import load_preset


def test_k2_total_and_active_exact():
    report = count_parameters(load_preset("k2"))
    assert report.total == 1_026_408_232_448
    assert report.active == pytest.approx(32.86e9, rel=1e-3)
    assert report.per_expert == 3 * 7168 * 2048 == 44_040_192
    assert report.components["router"] == 60 * (384 * 7168 + 384)
    assert report.components["attention"] == 61 * 101_124_096


def test_moonlight_and_deepseek_v3():
    moon = count_parameters(load_preset("moonlight-16b-a3b"))
    assert round(moon.total_excl_embeddings / 1e9, 2) == 15.29
    assert round(moon.active_excl_embeddings / 1e9, 2) == 2.24
    v3 = count_parameters(load_preset("deepseek-v3"))
    assert round(v3.total / 1e9, 2) == 671.03


def test_params_cli_json():
    out = subprocess.run(
        [sys.executable, "-m", "k2lab", "params", "--preset", "k2", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    assert data["total"] == 1_026_408_232_448
    assert round(data["active"] / 1e9, 2) == 32.86


def test_params_json_of_a_vision_language_preset_names_the_preset_asked_for(capsys):
    """`params -p k25-mini --json` said "preset": "k2-mini" (its language model)."""
    from k2lab.cli import main

    with pytest.raises(SystemExit):
        main(["params", "--preset", "k25-mini", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["preset"] == "k25-mini" and data["language_model"] == "k2-mini" and data["vision_language"]


def kda_layer_params(D: int, H: int, K: int, kernel: int, full_rank_gate: bool) -> int:
    """Hand count of one KDA layer (projections, conv, forget gate, beta, output gate, norm)."""
    width = H * K
    qkv = 3 * D * width + 3 * width * kernel
    forget = D * K + K * width + H + width  # f_a, f_b, A_log, dt_bias
    gate = D * width if full_rank_gate else D * K + K * width
    return qkv + forget + D * H + gate + K + width * D  # + b_proj, gate, o_norm, o_proj


def test_k3_exact_and_beside_the_report():
    report = count_parameters(load_preset("k3"))
    assert report.total == 2_779_484_476_000
    assert round(report.total / 1e12, 2) == 2.78
    assert report.active_excl_embeddings < 104.2e9 < report.active  # the report's figure lies between
    assert report.per_expert == 3 * 3584 * 3072
    D = 7168
    kda = kda_layer_params(D, 96, 128, 4, full_rank_gate=True)
    mla = (D * 1536 + 1536 + 1536 * 96 * 192) + (D * 576 + 512 + 512 * 96 * 256) + 96 * 128 * D * 2
    assert report.components["attention"] == 69 * kda + 24 * mla
    assert report.components["latent_projection"] == 92 * (2 * D * 3584 + 3584)
    assert report.components["shared_experts"] == 92 * 3 * D * 6144
    assert report.components["attnres"] == (2 * 93 + 1) * 2 * D


def test_kimi_linear_exact():
    report = count_parameters(load_preset("kimi-linear-48b-a3b"))
    assert report.total == 49_122_681_728
    D = 2304
    kda = kda_layer_params(D, 32, 128, 4, full_rank_gate=False)
    mla = D * 32 * 192 + D * 576 + 512 + 512 * 32 * 256 + 32 * 128 * D
    assert report.components["attention"] == 20 * kda + 7 * mla


def test_deepseek_v3_with_its_mtp_layer():
    """DeepSeek-V3's config.json has num_nextn_predict_layers = 1; the preset, like the report's 671B,
    leaves it out. With it: one more MLA + MoE layer, eh_proj [D, 2D] and three norms, hand-counted; with
    the checkpoint's copies of embedding and head, 684.5B (the model card: "685B, 671B main + 14B MTP")."""
    base = count_parameters(load_preset("deepseek-v3"))
    assert base.components["mtp"] == 0
    report = count_parameters(load_preset("deepseek-v3", num_nextn_predict_layers=1))
    D, E, F, V = 7168, 256, 2048, 129280
    attention = (D * 1536 + 1536 + 1536 * 128 * 192) + (D * 576 + 512 + 512 * 128 * 256) + 128 * 128 * D
    moe_layer = E * 3 * D * F + 3 * D * F + E * D + E  # routed, one shared expert, router weight and bias
    mtp = 2 * D * D + 3 * D + attention + moe_layer + 2 * D  # eh_proj, enorm/hnorm/final norm, block
    assert report.components["mtp"] == mtp == report.total - base.total
    assert report.active - base.active == mtp - (E - 8) * 3 * D * F
    assert report.moe_layers == base.moe_layers + 1
    assert round((report.total + 2 * V * D) / 1e9, 1) == 684.5


def test_a_model_that_cannot_fit_is_refused_before_it_is_built(monkeypatch):
    """``k2lab train --preset k2`` tried to allocate terabytes and ended in the allocator's traceback."""
    import k2lab.params as params
    from k2lab.errors import K2LabError
    from k2lab.optim.grouping import OptimizerConfig
    from k2lab.optim.stability import stability_run

    nano = load_preset("k2-nano")
    need = 3 * 4 * count_parameters(nano).total
    monkeypatch.setattr(params, "available_memory", lambda: need)
    params.check_fits_in_memory(nano, "training", copies=3)  # exactly fits
    monkeypatch.setattr(params, "available_memory", lambda: need - 1)
    with pytest.raises(K2LabError, match=r"k2-nano has .* training needs about .* GB \(3 fp32 copies\)"):
        params.check_fits_in_memory(nano, "training", copies=3)
    with pytest.raises(K2LabError, match="a stability run needs"):
        stability_run(nano, OptimizerConfig(), steps=1)
    with pytest.raises(K2LabError, match=r"^k25-nano \(language model k2-nano\) has"):  # the preset asked for
        params.check_fits_in_memory(nano, "training", copies=3, name="k25-nano")
    monkeypatch.setattr(params, "available_memory", lambda: None)  # unknown: no refusal
    params.check_fits_in_memory(load_preset("k2"), "training", copies=3)


def test_available_memory_reads_the_os():
    from k2lab.params import available_memory

    value = available_memory()
    assert value is None or value > 0
