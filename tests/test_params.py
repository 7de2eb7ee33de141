import json
import subprocess
import sys

import pytest

from k2lab.config import load_preset
from k2lab.params import count_parameters


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
