"""k2lab.optim.Muon against torch.optim.Muon, torch.optim.AdamW and hand-computed Newton–Schulz."""

import threading

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import k2lab.optim.muon_groups as muon_groups
from k2lab import build_model, load_preset
from k2lab.hardware import Choice
from k2lab.optim.grouping import OptimizerConfig, build_optimizer, parameter_groups
from k2lab.optim.muon import (
    MAX_BATCH,
    NS_COEFFICIENTS,
    Muon,
    balanced_shares,
    lr_ratio,
    newton_schulz,
    newton_schulz_flops,
    same_shape_batches,
)


def run_steps(optimizer, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("shape", [(48, 32), (32, 80), (40, 40)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon(shape, adjust_lr_fn, nesterov):
    torch.manual_seed(0)
    weight = torch.randn(shape)
    grads = [[torch.randn(shape)] for _ in range(3)]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    reference = torch.nn.Parameter(weight.clone())
    run_steps(torch.optim.Muon([reference], **kwargs), [reference], grads)

    ours_bf16 = torch.nn.Parameter(weight.clone())
    run_steps(Muon([ours_bf16], ns_dtype=torch.bfloat16, **kwargs), [ours_bf16], grads)
    torch.testing.assert_close(ours_bf16, reference, rtol=0, atol=1e-6)  # same arithmetic, fp32 rounding only

    ours_fp32 = torch.nn.Parameter(weight.clone())
    run_steps(Muon([ours_fp32], ns_dtype=torch.float32, **kwargs), [ours_fp32], grads)
    # torch runs Newton–Schulz in bf16 (relative error ~2^-8 per entry of the update): lr·r·2^-8·few
    torch.testing.assert_close(ours_fp32, reference, rtol=0, atol=3e-3)


def exact_bf16_muon(weight, grads, lr, weight_decay, momentum, adjust_lr_fn):
    """torch.optim.Muon's step on a bf16 matrix (its bf16 momentum and Newton–Schulz), with W − lr·r·O
    computed exactly and rounded to bf16 once."""
    param, buffer = weight.clone(), torch.zeros_like(weight)
    for grad in grads:
        buffer.lerp_(grad, 1 - momentum)
        ortho = _zeropower_via_newtonschulz(grad.lerp(buffer, momentum), NS_COEFFICIENTS, 5, 1e-7)
        param.mul_(1 - lr * weight_decay)
        step = lr * lr_ratio(adjust_lr_fn, *weight.shape) * ortho.double()
        param = (param.double() - step).to(torch.bfloat16)
    return param


@pytest.mark.parametrize("shape", [(48, 32), (12, 40)], ids=["batched", "per-tensor"])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_bf16_parameters_are_rounded_once(shape, adjust_lr_fn):
    """r·O was rounded to bf16 before W − lr·(r·O) rounded again: 1 ulp off in ~1% of the entries. Now each
    entry is the exact update rounded once (torch.optim.Muon rounds lr·r to bf16, ~0.4% 1 ulp off that)."""
    torch.manual_seed(0)
    weights = [torch.randn(shape).bfloat16() for _ in range(2)]
    grads = [[torch.randn(shape).bfloat16() for _ in weights] for _ in range(3)]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn=adjust_lr_fn)
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    run_steps(Muon(ours, ns_dtype=torch.bfloat16, nesterov=True, **kwargs), ours, grads)
    for i, (mine, weight) in enumerate(zip(ours, weights, strict=True)):
        expected = exact_bf16_muon(weight, [step[i] for step in grads], **kwargs)
        assert mine.dtype == torch.bfloat16 and torch.equal(mine.detach(), expected)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-workers"])
def threads(request):
    """Muon.step runs its batches in one thread, or dealt to two one-thread workers (``_run_batches``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_same_shape_batches_match_torch_muon_per_matrix(threads, monkeypatch):
    """Same-shape 2-D matrices (wide and tall) share one batched Newton–Schulz, a 3-D tensor is its own batch
    (one more than MAX_BATCH of a shape opens a second batch; matrices with a side of 16 or less stay alone,
    as torch would not send their products to oneDNN): each equals torch.optim.Muon on its matrix."""
    torch.manual_seed(5)
    shapes = [(24, 40)] * (MAX_BATCH + 1) + [(40, 24)] * 2 + [(16, 40)] * 2 + [(3, 16, 16)] * 2 + [(20, 16)]
    weights = [torch.randn(shape) for shape in shapes]
    grads = [[torch.randn(shape) for shape in shapes] for _ in range(3)]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, adjust_lr_fn="match_rms_adamw")
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    assert [len(b) for b in same_shape_batches(ours)] == [MAX_BATCH, 1, 2, 1, 1, 1, 1, 1]
    optimizer = Muon(ours, ns_dtype=torch.bfloat16, **kwargs)
    workers = []  # the thread of each worker share (_work) run
    work = Muon._work
    monkeypatch.setattr(
        Muon, "_work", lambda self, *a: workers.append(threading.get_ident()) or work(self, *a)
    )
    run_steps(optimizer, ours, grads[:-1])
    # two steps, each dealt to two workers off the calling thread (none with one thread)
    assert len(workers) == (4 if threads == 2 else 0) and threading.get_ident() not in workers
    assert torch.get_num_threads() == threads  # the caller's count is back after the workers
    before = [p.detach().clone() for p in ours]
    run_steps(optimizer, ours, grads[-1:])
    reference = [
        torch.nn.Parameter(m.clone()) for w in weights for m in (w.unbind(0) if w.ndim == 3 else [w])
    ]
    split = [[m for g in step for m in (g.unbind(0) if g.ndim == 3 else [g])] for step in grads]
    run_steps(torch.optim.Muon(reference, **kwargs), reference, split)
    flat = [m for p in ours for m in (p.unbind(0) if p.ndim == 3 else [p])]
    for mine, theirs in zip(flat, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    # last_update_rms is the RMS of r·O = (W·(1 − lr·wd) − W_new) / lr over every matrix entry
    steps = torch.cat(
        [((b * (1 - 0.02 * 0.1) - p.detach()) / 0.02).flatten() for b, p in zip(before, ours, strict=True)]
    )
    assert optimizer.last_update_rms == pytest.approx(float(steps.square().mean().sqrt()), rel=1e-4)


def test_balanced_shares_deal_largest_first_to_the_least_loaded():
    batches = [
        [torch.zeros(4, 32, 32)],
        [torch.zeros(32, 32)] * 3,
        [torch.zeros(2, 32, 32)],
        [torch.zeros(32, 32)],
    ]
    shares = balanced_shares(batches, 2)
    assert sorted(id(b) for share in shares for b in share) == sorted(id(b) for b in batches)
    loads = [sum(newton_schulz_flops(b) for b in share) for share in shares]
    assert loads[0] == loads[1] == 5 * newton_schulz_flops([torch.zeros(32, 32)])  # 4 + 1 against 3 + 2


def test_newton_schulz_hand_iteration():
    torch.manual_seed(1)
    g = torch.randn(6, 9)
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / g.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(newton_schulz(g), x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(newton_schulz(g.T), x.T, rtol=1e-5, atol=1e-6)  # tall: transposed


def test_expert_weights_orthogonalised_per_expert_in_one_batch():
    torch.manual_seed(2)
    experts = torch.nn.Parameter(torch.randn(5, 12, 20))
    separate = [torch.nn.Parameter(experts[e].detach().clone()) for e in range(5)]
    grads = [torch.randn(5, 12, 20) for _ in range(2)]
    run_steps(Muon([experts], lr=0.01), [experts], [[g] for g in grads])
    run_steps(Muon(separate, lr=0.01), separate, [list(g.unbind(0)) for g in grads])
    torch.testing.assert_close(
        experts.detach(), torch.stack([p.detach() for p in separate]), rtol=0, atol=1e-6
    )


def test_per_head_blocks_equal_newton_schulz_by_hand():
    torch.manual_seed(3)
    blocks = [4, 6, 4, 6]
    weight = torch.nn.Parameter(torch.zeros(20, 16))
    grad = torch.randn(20, 16)
    weight.grad = grad.clone()
    Muon(
        [dict(params=[weight], row_blocks=blocks)],
        lr=1.0,
        weight_decay=0,
        momentum=0,
        nesterov=False,
        ns_dtype=torch.float32,
    ).step()
    expected, start = [], 0
    for rows in blocks:
        ratio = max(1.0, rows / 16) ** 0.5
        expected.append(-ratio * newton_schulz(grad[start : start + rows]))
        start += rows
    torch.testing.assert_close(weight.detach(), torch.cat(expected), rtol=1e-5, atol=1e-6)


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(4)
    weight = torch.randn(7)
    grads = [[torch.randn(7)] for _ in range(5)]
    ours = torch.nn.Parameter(weight.clone())
    reference = torch.nn.Parameter(weight.clone())
    group = dict(params=[ours], kind="adamw", lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), adam_eps=1e-8)
    run_steps(Muon([group]), [ours], grads)
    run_steps(
        torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95)), [reference], grads
    )
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7)


def test_vectors_rejected_from_muon_groups():
    with pytest.raises(ValueError, match="kind='adamw'"):
        Muon([torch.nn.Parameter(torch.zeros(3))])


def test_grouping_covers_every_parameter_once():
    model = build_model(load_preset("k2-nano"))
    groups = parameter_groups(model, OptimizerConfig(per_head_muon=True))
    seen = [id(p) for g in groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    by_name = {n: g["kind"] for g in groups for n in g["names"]}
    assert by_name["embed.weight"] == by_name["lm_head.weight"] == by_name["norm.weight"] == "adamw"
    assert by_name["layers.1.mlp.experts.gate_proj"] == by_name["layers.0.attn.kv_down.weight"] == "muon"
    assert "layers.1.mlp.router.e_score_correction_bias" not in by_name  # a buffer: no gradient
    q_group = next(g for g in groups if "layers.0.attn.q_up.weight" in g["names"])
    assert q_group["row_blocks"] == [24, 24]  # per head: 16 nope + 8 rope rows
    kv_group = next(g for g in groups if "layers.0.attn.kv_up.weight" in g["names"])
    assert kv_group["row_blocks"] == [16, 16, 16, 16]  # per head: k nope rows, then v rows


def test_build_optimizer_prints_grouping(capsys):
    model = build_model(load_preset("k2-nano"))
    build_optimizer(model, OptimizerConfig())
    out = capsys.readouterr().out
    assert "muon" in out and "adamw" in out and "e_score_correction_bias" in out


def test_newton_schulz_precision_is_chosen_for_the_parameters_device(monkeypatch):
    asked: list[str] = []

    def choose(path, requested="auto", device="cpu"):
        asked.append(device)
        return Choice(torch.float32, "test")

    monkeypatch.setattr(muon_groups, "choose", choose)
    Muon([torch.nn.Parameter(torch.empty(4, 4, device="meta"))])  # where the parameters live, not the CPU
    build_optimizer(torch.nn.Linear(4, 4, bias=False).to("meta"), OptimizerConfig(), verbose=False)
    assert asked == ["meta", "meta"]
