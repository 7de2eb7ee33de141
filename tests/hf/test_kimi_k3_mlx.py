"""The kimi_k3 layout against an independent implementation: mlx-lm 0.32.2's ``kimi_k3`` on MLX's CPU backend.

Both directions run a tiny random K3 (5 layers: KDA at 1, 3, 4 and MLA at 2, 5 (1-based), layer 0 dense, the rest
latent MoE with 2 shared experts and top-3 of 8 routed, q_lora_rank set, Block AttnRes of 2 layers, so the last
reads hold the embedding, 2 completed blocks and a partial one) with every parameter drawn at random, including
what init leaves trivial (AttnRes queries, norm weights, router biases, A_log, dt_bias), and compare fp32
logits on a batch of 2 × 16 tokens (max abs diff ≤ 1e-4, at logits of magnitude ~3).

- k2lab -> mlx: ``k2lab.hf.to_hf`` writes the model in the kimi_k3 layout and mlx-lm loads the directory with
  its own loader (config parsing, ``sanitize``, strict weight check). Equal logits prove that our forward pass is
  the released one (AttnRes block boundaries and read points, NoPE gated MLA, KDA gate / conv / norms, SiTU-GLU,
  latent MoE, router) and that every tensor our writer emits lands where the released code reads it. With MTP
  layers present mlx-lm drops them; the main logits must still match (the MTP tensors do not disturb the rest).
- mlx -> k2lab: an mlx ``kimi_k3.Model`` built from a config written by hand here (``mlx_k3.released_config``),
  its parameters written in the released layout by ``mlx_k3.released_state`` (mlx's ``sanitize`` undone, a
  writer independent of ``to_hf``), read by ``k2lab.hf.from_hf``. Equal logits prove that our reader and config
  parser understand the released names, shapes and fields as the released code does (also for a variant with
  ``latent_moe_use_norm: false`` and a direct ``q_proj``). The writer itself is
  checked first: mlx-lm reloads its output to identical logits. The loaded model's cached decoding (prefill,
  then one token at a time) must give the same logits too, so the decode paths follow the released semantics.
- Power: the same weights with one setting changed (AttnRes block size, KDA gate bound, SiTU β1, top-k) miss
  mlx-lm's logits by more than 10× the tolerance.

What the released code has that these configs cannot express is listed in the docstrings of ``k2lab.nn``
(router corners at k = 1, an uncapped SiTU up branch); none of it is used by K3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

pytest.importorskip("mlx_lm.models.kimi_k3")

from k2lab import build_model, load_preset  # noqa: E402
from k2lab.config import ModelConfig  # noqa: E402
from k2lab.hf import from_hf, to_hf  # noqa: E402
from k2lab.infer.cache import LatentCache  # noqa: E402
from k2lab.models import CausalLM  # noqa: E402
from k2lab.presets.vision_language import load_vlm_preset  # noqa: E402
from k2lab.vision.vlm import build_vlm  # noqa: E402
from tests.conftest import randomize  # noqa: E402
from tests.hf import mlx_k3  # noqa: E402

TOLERANCE = 1e-4
K3_TINY = dict(
    num_hidden_layers=5,
    mla_layers=(2, 5),
    attnres_block_size=2,
    first_k_dense_replace=1,
    num_experts_per_tok=3,
    n_shared_experts=2,
    rms_norm_eps=1e-5,
)


def tiny_config(**overrides: object) -> ModelConfig:
    config = load_preset("k3-nano", **(K3_TINY | overrides))
    assert config.layer_types == ("kda", "mla", "kda", "kda", "mla")
    return config


def token_ids(config: ModelConfig) -> np.ndarray:
    return np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))


@torch.no_grad()
def our_logits(model: CausalLM, ids: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(ids)).logits.float().numpy()


def assert_close(ours: np.ndarray, reference: np.ndarray) -> None:
    diff = float(np.abs(ours - reference).max())
    assert diff <= TOLERANCE, f"max abs logit diff {diff:.3g} > {TOLERANCE}"
    assert np.abs(reference).max() > 1.0  # not a vacuous match of near-zero logits


@pytest.mark.parametrize(
    "overrides",
    [{}, {"num_nextn_predict_layers": 1, "moe_latent_norm": False}],
    ids=["k3", "mtp-no-latent-norm"],
)
def test_k2lab_checkpoint_loads_in_mlx_with_equal_logits(tmp_path: Path, overrides: dict) -> None:
    config = tiny_config(**overrides)
    model = randomize(build_model(config), std=0.1)
    to_hf(model, tmp_path / "k3")
    assert json.loads((tmp_path / "k3" / "config.json").read_text())["model_type"] == "kimi_k3"
    if config.num_nextn_predict_layers:  # written, and skipped by mlx-lm's sanitize
        with safe_open(tmp_path / "k3" / "model.safetensors", "np") as f:
            names = set(f.keys())
        assert f"language_model.model.layers.{config.num_hidden_layers}.eh_proj.weight" in names
    reference = mlx_k3.load(tmp_path / "k3")  # strict: every tensor mlx-lm expects, nothing it does not know
    ids = token_ids(config)
    assert_close(our_logits(model, ids), mlx_k3.logits(reference, ids))


def write_mlx_checkpoint(config: ModelConfig, path: Path) -> tuple[object, Path]:
    """A random mlx kimi_k3 model of ``config`` and its released-layout directory (the test's own writer)."""
    released = mlx_k3.released_config(config)
    model = mlx_k3.random_model(released, seed=1)
    return model, mlx_k3.write_checkpoint(path, released, mlx_k3.released_state(model))


@pytest.fixture(scope="module")
def mlx_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    return write_mlx_checkpoint(tiny_config(), tmp_path_factory.mktemp("mlx") / "k3")


def test_released_writer_round_trips_through_mlx_sanitize(mlx_checkpoint: tuple[object, Path]) -> None:
    model, path = mlx_checkpoint
    ids = token_ids(tiny_config())
    np.testing.assert_array_equal(mlx_k3.logits(mlx_k3.load(path), ids), mlx_k3.logits(model, ids))


def test_mlx_checkpoint_loads_in_k2lab_with_equal_logits(mlx_checkpoint: tuple[object, Path]) -> None:
    model, path = mlx_checkpoint
    ours = from_hf(path)
    assert isinstance(ours, CausalLM)
    assert ours.config.layer_types == tiny_config().layer_types
    ids = token_ids(ours.config)
    assert_close(our_logits(ours.eval(), ids), mlx_k3.logits(model, ids))


def test_mlx_variant_loads_in_k2lab_with_equal_logits(tmp_path: Path) -> None:
    """No latent norm (``latent_moe_use_norm: false``, mlx-lm's default) and a direct ``q_proj``."""
    config = tiny_config(moe_latent_norm=False, q_lora_rank=None)
    model, path = write_mlx_checkpoint(config, tmp_path / "k3")
    ours = from_hf(path)
    assert ours.config.moe_latent_norm is False and ours.config.q_lora_rank is None
    ids = token_ids(config)
    assert_close(our_logits(ours.eval(), ids), mlx_k3.logits(model, ids))


@torch.no_grad()
def test_cached_decoding_matches_the_mlx_prefill(mlx_checkpoint: tuple[object, Path]) -> None:
    """Our decode path (absorbed MLA over the latent cache, recurrent KDA with the conv state) after a
    10-token prefill, one token at a time, gives mlx-lm's full-sequence logits."""
    model, path = mlx_checkpoint
    ours = from_hf(path).eval()
    ids = token_ids(ours.config)
    cache = LatentCache(ours.config, batch_size=ids.shape[0], max_length=ids.shape[1])
    steps = [ours(torch.from_numpy(ids[:, :10]), cache=cache).logits]
    steps += [ours(torch.from_numpy(ids[:, t : t + 1]), cache=cache).logits for t in range(10, ids.shape[1])]
    assert_close(torch.cat(steps, dim=1).numpy(), mlx_k3.logits(model, ids))


@pytest.mark.parametrize(
    "change",
    [
        {"attnres_block_size": 3},
        {"kda_gate_lower_bound": -4.0},
        {"situ_beta1": 3.0},
        {"num_experts_per_tok": 2},
    ],
    ids=["block-size", "gate-bound", "situ-beta", "top-k"],
)
def test_the_comparison_notices_a_changed_semantic(mlx_checkpoint: tuple[object, Path], change: dict) -> None:
    """The same weights under one changed setting are far outside the tolerance: the match above is not loose."""
    model, path = mlx_checkpoint
    loaded = from_hf(path)
    changed = build_model(loaded.config.replace(**change))
    changed.load_state_dict(loaded.state_dict())
    ids = token_ids(loaded.config)
    assert np.abs(our_logits(changed.eval(), ids) - mlx_k3.logits(model, ids)).max() > 10 * TOLERANCE


def test_a_k3_vlm_export_gives_mlx_the_same_text_model(tmp_path: Path) -> None:
    """A K3 vision-language model is written as kimi_k3 with a vision_config; mlx-lm (text only) drops the
    tower and projector and must read the language model it holds: equal text-only logits."""
    vlm = build_vlm(load_vlm_preset("k3-vl-nano", **K3_TINY))
    randomize(vlm, std=0.1)
    to_hf(vlm, tmp_path / "k3-vl")
    written = json.loads((tmp_path / "k3-vl" / "config.json").read_text())
    assert written["model_type"] == "kimi_k3" and "vision_config" in written
    reference = mlx_k3.load(tmp_path / "k3-vl")
    ids = token_ids(vlm.config.text)
    assert_close(our_logits(vlm.language_model, ids), mlx_k3.logits(reference, ids))
