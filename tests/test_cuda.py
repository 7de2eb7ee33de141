"""The CUDA paths against the CPU and eager references. Skipped without a GPU (CI has none); on a machine
with one: ``python -m pytest tests/test_cuda.py``.

What runs only on CUDA here: the fused ``torch._grouped_mm`` in bf16 (the CPU takes fp32 too), fla's triton
KDA kernels (``k2lab.ops.kda`` dispatches to them for CUDA tensors), the compiled training forward and
decode step built by inductor for the GPU, and a one-process ``k2lab train`` on the GPU.

fp32 comparisons run with TF32 off (``torch.set_float32_matmul_precision("highest")``), so a CUDA product
differs from the CPU's only in summation order: relative errors of a few ulps times the depth, far below the
1e-4 bounds used. fla's kernels compute their dots in TF32 (10-bit mantissa, ≈ 5e-4 relative per
product) whatever the matmul setting, hence their looser 1e-2 bounds.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from k2lab import build_model, load_preset
from k2lab.hardware import choose
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.draft import EagleDraft
from k2lab.infer.speculative import speculative_generate
from k2lab.ops.grouped_mm import _grouped_mm_supported, grouped_matmul, grouped_matmul_loop
from k2lab.ops.kda import chunk_kda, kda, recurrent_kda
from k2lab.optim import OptimizerConfig
from k2lab.optim.muonclip import MuonClip
from k2lab.train.compile import compiled
from k2lab.train.config import load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.run_checkpoints import list_checkpoints
from k2lab.train.trainer import run_training
from tests.conftest import randomize
from tests.ops.test_kda import make_inputs
from tests.train.test_trainer import recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
FP32 = 1e-4  # relative, fp32 on both sides (summation order only)
TF32 = 1e-2  # relative, fla's TF32 dots against fp32
PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [99]]


@pytest.fixture(autouse=True)
def exact_fp32():
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in fp32 on the CPU."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def model(preset: str = "k2-nano", **overrides: object):
    return randomize(build_model(load_preset(preset, **overrides)))


def loss_and_grads(net, ids: torch.Tensor, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    loss = (net if forward is None else forward)(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None
    }


def assert_grads_close(got: dict, want: dict, bound: float) -> None:
    assert got.keys() == want.keys()
    worst = max(want, key=lambda n: relative(got[n], want[n]))
    assert relative(got[worst], want[worst]) <= bound, worst


def test_hardware_picks_bf16_on_a_cuda_device_that_runs_it():
    choice = choose("autocast", device="cuda")
    assert choice.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32)
    assert "cuda" in choice.reason.lower()


def test_grouped_matmul_runs_the_fused_bf16_kernel_and_matches_the_loop():
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 3, 0, 40, 1, 6])  # empty experts included
    x = torch.randn(int(counts.sum()), 64, generator=generator).to(CUDA, torch.bfloat16).requires_grad_()
    w = torch.randn(8, 32, 64, generator=generator).to(CUDA, torch.bfloat16).requires_grad_()
    dy = torch.randn(x.shape[0], 32, generator=generator).to(CUDA, torch.bfloat16)
    assert _grouped_mm_supported(x, 64, 32, 64)  # the fused kernel, not the loop
    y = grouped_matmul(x, w, counts.to(CUDA))
    y.backward(dy)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = grouped_matmul_loop(x32, w32, counts.tolist())
    y32.backward(dy.float())
    # bf16 output rounding (2^-8 relative) on fp32 accumulation of bf16 products
    assert relative(y, y32) <= 2**-7
    assert relative(x.grad, x32.grad) <= 2**-7 and relative(w.grad, w32.grad) <= 2**-7
    assert w.grad[1].abs().max() == 0 and w.grad[4].abs().max() == 0


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano"])
def test_forward_and_backward_on_cuda_match_the_cpu(preset):
    cpu = model(preset)
    gpu = copy.deepcopy(cpu).to(CUDA)
    ids = torch.randint(3, cpu.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    loss, grads = loss_and_grads(cpu.train(), ids)
    loss_gpu, grads_gpu = loss_and_grads(gpu.train(), ids.to(CUDA))
    bound = FP32 if preset == "k2-nano" else TF32  # k3: KDA through fla's kernels on CUDA
    assert relative(loss_gpu, loss) <= bound
    assert_grads_close(grads_gpu, grads, bound)


def test_fla_kda_kernels_match_the_chunked_reference():
    x = {k: None if v is None else v.to(CUDA) for k, v in make_inputs(100, HV=2, state=True).items()}
    leaves = {k: x[k].clone().requires_grad_() for k in ("q", "k", "v", "g", "beta")}
    twins = {k: x[k].clone().requires_grad_() for k in ("q", "k", "v", "g", "beta")}
    o, s = kda(**leaves, initial_state=x["initial_state"], output_final_state=True, backend="fla")
    o_ref, s_ref = chunk_kda(**twins, initial_state=x["initial_state"], output_final_state=True)
    assert relative(o, o_ref) <= TF32 and relative(s, s_ref) <= TF32
    weights = torch.randn_like(o_ref)
    (o * weights).sum().backward()
    (o_ref * weights).sum().backward()
    for name in leaves:
        assert relative(leaves[name].grad, twins[name].grad) <= TF32, name
    step = {name: x[name][:, :1] for name in ("q", "k", "v", "g", "beta")}
    step["initial_state"] = x["initial_state"]
    with torch.no_grad():  # one token without gradients: fla's fused recurrent kernel
        o1, s1 = kda(**step, output_final_state=True)
        o1_ref, s1_ref = recurrent_kda(**step, output_final_state=True)
    assert relative(o1, o1_ref) <= TF32 and relative(s1, s1_ref) <= TF32


def test_compiled_training_forward_on_cuda_matches_eager():
    net = model().to(CUDA).train()
    ids = torch.randint(3, net.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    loss, grads = loss_and_grads(net, ids.to(CUDA))
    loss_c, grads_c = loss_and_grads(net, ids.to(CUDA), forward=compiled(net))
    assert relative(loss_c, loss) <= FP32
    assert_grads_close(grads_c, grads, FP32)


def test_greedy_decoding_on_cuda_equals_the_cpu_eager_and_compiled():
    cpu = model()
    gpu = copy.deepcopy(cpu).to(CUDA)
    config = GenerationConfig(max_new_tokens=12, eos_token_id=None)
    want = generate(cpu, PROMPTS, config)
    assert generate(gpu, PROMPTS, config) == want
    assert generate(gpu, PROMPTS, config.model_copy(update={"compile": "on"})) == want


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano"])
def test_speculative_greedy_on_cuda_equals_plain_decoding(preset):
    target = model(preset, num_nextn_predict_layers=1).to(CUDA)
    config = GenerationConfig(max_new_tokens=11, eos_token_id=None)
    plain = generate(target, PROMPTS, config)
    out, stats = speculative_generate(target, EagleDraft(target, target.mtp[0]), PROMPTS, config, 3)
    assert out == plain and stats.steps > 0


def test_muonclip_step_on_cuda_matches_the_cpu():
    cpu = model().train()
    gpu = copy.deepcopy(cpu).to(CUDA)
    ids = torch.randint(3, cpu.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(3))
    settings = OptimizerConfig(ns_precision="fp32", qk_clip_tau=1.0)  # a low τ: QK-Clip rescales heads
    optimizers = [MuonClip(net, settings, verbose=False) for net in (cpu, gpu)]
    loss_and_grads(cpu, ids)
    loss_and_grads(gpu, ids.to(CUDA))
    stats = [optimizer.step() for optimizer in optimizers]
    assert stats[0].keys() == stats[1].keys()
    params = dict(cpu.named_parameters())
    for name, param in gpu.named_parameters():
        assert relative(param, params[name]) <= FP32, name


def test_one_process_training_runs_on_the_gpu(tmp_path, tiny_corpus):
    first = {}
    for index, device in enumerate(("cpu", "cuda")):  # eager fp32 on both: the same first step
        out = tmp_path / f"run{index}"
        run_training(
            load_train_config(recipe(tmp_path, tiny_corpus, out, steps=2), device=device, compile="off")
        )
        first[device] = read_metrics(out)[0]["loss"]
    assert abs(first["cuda"] - first["cpu"]) <= FP32 * abs(first["cpu"])
    out = tmp_path / "compiled"  # the defaults on a GPU: compiled step, bf16 autocast
    config = load_train_config(recipe(tmp_path, tiny_corpus, out, steps=6), precision="auto", compile="auto")
    run_training(config)
    rows = read_metrics(out)
    assert len(rows) == 6 and all(torch.isfinite(torch.tensor(row["loss"])) for row in rows)
    assert list_checkpoints(out)
