"""Quantile Balancing (K3): the rule against a per-token / per-expert loop, what it guarantees on one batch, and
how it balances a stream of batches compared with the DeepSeek-V3 sign rule."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from k2lab.nn.balancing import deepseek_bias_update, quantile_balance, quantile_bias, quantile_bias_update
from k2lab.nn.moe import MoE
from k2lab.nn.router import SigmoidRouter
from k2lab.presets import load_preset
from tests.conftest import free_port

SHAPES = [
    (64, 8, 2),
    (100, 7, 2),
    (512, 16, 4),
    (96, 12, 3),
    (40, 64, 1),
]  # q = 16, 28.57→28, 128, 24, 0.625→0


def skewed_scores(m: int, n: int, skew: float, generator: torch.Generator) -> torch.Tensor:
    """Sigmoid scores [m, n] whose expert j is favoured by skew·(2j/(n−1) − 1) in logit space."""
    return (torch.randn(m, n, generator=generator) + skew * torch.linspace(-1, 1, n)).sigmoid()


def loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k loads [n] of the biased scores (no group limit), as ``SigmoidRouter`` selects."""
    picks = (scores + bias).topk(k, dim=1).indices
    return torch.bincount(picks.reshape(-1), minlength=scores.shape[1]).float()


def loop_reference(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    m, n = scores.shape
    biased = (scores + bias).tolist()
    alpha = [sorted(row, reverse=True)[k] for row in biased]  # (k+1)-th largest
    q = (m * k) // n
    new = []
    for j in range(n):
        margins = sorted((biased[i][j] - alpha[i] for i in range(m)), reverse=True)
        new.append(bias[j].item() - margins[q])  # (q+1)-th largest
    return torch.tensor(new)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_rule_matches_per_expert_loop(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    scores, bias = skewed_scores(m, n, 2.0, g), 0.1 * torch.randn(n, generator=g)
    torch.testing.assert_close(
        quantile_bias(scores, bias, k), loop_reference(scores, bias, k), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("skew", [0.0, 4.0])
def test_each_expert_clears_its_quantile_against_the_batch_thresholds(m, n, k, skew):
    """With the tokens' thresholds α_i held fixed, every expert clears exactly q = ⌊m·k/n⌋ tokens."""
    g = torch.Generator().manual_seed(7)
    scores, bias = skewed_scores(m, n, skew, g), torch.zeros(n)
    q = (m * k) // n
    alpha = (scores + bias).topk(k + 1, dim=1).values[:, k : k + 1]
    margins = scores + bias - alpha  # [m, n]; exactly one 0 per token (its (k+1)-th expert), else no ties
    cut = bias - quantile_bias(scores, bias, k)
    cleared = (margins > cut).sum(0)
    assert ((margins >= cut).sum(0) >= q + 1).all()
    # c_j ≠ 0: exactly q tokens clear it. c_j = 0: j's (q+1)-th margin is one of the structural zeros, so it
    # keeps its bias with load ≤ q (an under-loaded runner-up expert is not raised by this step).
    assert (cleared[cut != 0] == q).all()
    assert (cleared[cut == 0] <= q).all()


@pytest.mark.parametrize(("m", "n", "k"), [(64, 8, 2), (512, 16, 4), (2048, 64, 8), (96, 12, 3)])
def test_rerouting_the_same_batch_moves_every_expert_toward_its_target(m, n, k):
    """Rerouted top-k loads come close to, not exactly to, q: α moves with b, and an expert that is the (k+1)-th
    choice of enough tokens gets c_j = 0. Measured (seed 0, skew 4; loads min..max of target q):
    (64,8,2) 0..62 -> 7..39 of 16; (512,16,4) 0..491 -> 65..219 of 128; (2048,64,8) 0..1640 -> 173..328 of 256;
    Σ|load − q| falls 158 -> 64, 2480 -> 532, 22368 -> 1250 (unskewed (2048,64,8): 700 -> 432)."""
    g = torch.Generator().manual_seed(0)
    for skew in (0.0, 4.0):
        scores, bias = skewed_scores(m, n, skew, g), torch.zeros(n)
        q = (m * k) // n
        before = (loads(scores, bias, k) - q).abs()
        after = (loads(scores, quantile_bias(scores, bias, k), k) - q).abs()
        assert after.max() < before.max()
        assert after.sum() < 0.75 * before.sum()
        if skew:
            assert after.max() <= 0.6 * before.max()


def stream(rule: str, steps: int, m=2048, n=32, k=4, skew=2.0, d=16, seed=0) -> list[float]:
    """max/mean load per step on fresh batches from one fixed router (x ~ N(0, I), logits = W x + skew ramp)."""
    g = torch.Generator().manual_seed(seed)
    weight, ramp = torch.randn(n, d, generator=g) / d**0.5, skew * torch.linspace(-1, 1, n)
    router = SigmoidRouter(
        load_preset("k2-nano", n_routed_experts=n, num_experts_per_tok=k, n_group=1, hidden_size=d)
    )
    ratios = []
    for _ in range(steps):
        scores = (torch.randn(m, d, generator=g) @ weight.T + ramp).sigmoid()
        load = loads(scores, router.e_score_correction_bias, k)
        ratios.append(float(load.max() / load.mean()))
        if rule == "quantile":
            quantile_bias_update(router, scores, k)
        else:
            deepseek_bias_update(router, load)
    return ratios


def test_repeated_updates_keep_fresh_batches_balanced_and_beat_the_sign_rule():
    """Measured max/mean (2048 tokens, 32 experts, top-4, skew 2): step 0 both 4.76; QB 1.17 mean over steps
    5–29 (max 1.27), about the sampling noise of a fresh batch (q = 256); DeepSeek γ=1e-3 4.39 over the same
    steps (its bias moves 1e-3 per step; 1.27 after 250–300 steps, where QB stays at 1.17)."""
    qb, ds = stream("quantile", 30), stream("deepseek", 30)
    assert qb[0] == ds[0] > 4
    assert max(qb[5:]) < 1.35
    assert sum(qb[5:]) / 25 < 1.25
    assert sum(ds[5:]) / 25 > 2.5


def test_edge_cases_and_router_update():
    g = torch.Generator().manual_seed(1)
    scores = skewed_scores(10, 4, 1.0, g)
    bias = torch.tensor([0.1, -0.2, 0.3, 0.0])
    assert torch.equal(quantile_bias(scores, bias, 4), bias)  # k = n: every token takes every expert
    assert torch.equal(quantile_bias(scores[:0], bias, 2), bias)  # no tokens
    # q = 0 (m·k < n): c_j is each expert's largest margin
    wide = skewed_scores(3, 8, 1.0, g)
    torch.testing.assert_close(
        quantile_bias(wide, torch.zeros(8), 2), loop_reference(wide, torch.zeros(8), 2)
    )

    router = SigmoidRouter(
        load_preset("k2-nano", n_routed_experts=4, num_experts_per_tok=2, n_group=1, hidden_size=8)
    )
    buffer = router.e_score_correction_bias
    buffer.copy_(bias)
    quantile_bias_update(router, scores)  # top_k defaults to the router's
    assert router.e_score_correction_bias is buffer
    want = quantile_bias(scores, bias, 2)
    torch.testing.assert_close(buffer, want - want.mean())  # mean-centred: the same routing
    assert torch.equal(loads(scores, buffer, 2), loads(scores, want, 2))


def test_moe_records_then_balances_its_router():
    config = load_preset("k2-nano", n_routed_experts=16, num_experts_per_tok=2, n_group=1, topk_group=1)
    torch.manual_seed(0)
    moe = MoE(config).train()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.router.weight.add_(torch.linspace(-1, 1, 16)[:, None] * 0.3)  # expert 15 favoured
    moe.record_scores = True
    x = torch.randn(4, 64, config.hidden_size)
    moe(x[:2])
    moe(x[2:])  # two micro-batches form one balancing batch
    before = moe.last_expert_counts.float()
    quantile_balance(moe)
    assert moe.recorded_scores == []
    assert moe.router.e_score_correction_bias.abs().sum() > 0
    moe(x[2:])
    after = moe.last_expert_counts.float()
    assert after.max() / after.mean() < before.max() / before.mean()


WORKER = textwrap.dedent(
    """
    import json, torch, torch.distributed as dist
    from k2lab.presets import load_preset
    from k2lab.nn.balancing import quantile_bias, quantile_bias_update
    from k2lab.nn.router import SigmoidRouter
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(2 * 96, 12, generator=g) + torch.linspace(-2, 2, 12)).sigmoid()
    config = load_preset("k2-nano", n_routed_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1)
    router = SigmoidRouter(config)
    quantile_bias_update(router, scores[rank * 96:(rank + 1) * 96])
    single = quantile_bias(scores, torch.zeros(12), 3)  # one process, whole batch
    if rank == 0:
        print("RESULT " + json.dumps({"dp": router.e_score_correction_bias.tolist(),
                                      "single": (single - single.mean()).tolist()}))
    gathered = [torch.zeros(12) for _ in range(2)]
    dist.all_gather(gathered, router.e_score_correction_bias)
    assert torch.equal(gathered[0], gathered[1])
    dist.destroy_process_group()
    """
)


@pytest.mark.timeout(300)
def test_data_parallel_ranks_agree_with_one_process_on_the_global_batch(tmp_path):
    script = tmp_path / "qb_worker.py"
    script.write_text(WORKER)
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={port}", str(script),
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["dp"] == result["single"]
