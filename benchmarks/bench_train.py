"""Training throughput and MFU: k2lab's trainer step versus a transformers ``DeepseekV3ForCausalLM`` step.

Both models hold the same weights at the start (``k2lab.hf.bridge.to_transformers``), see the same random
batch [batch, seq] (next-token labels), and run in one process under the same ``torch.set_num_threads``.

Sides:

* **k2lab** — one step of ``k2lab.train.trainer.Trainer``, exactly as ``k2lab train`` runs it:
  ``train_step()`` (forward with per-head max-logit recording, fp32 cross-entropy, backward, global
  gradient-norm clip at 1.0, lr schedule) then ``update()`` (MuonClip: Muon on hidden matrices with
  Newton–Schulz in the precision ``k2lab.hardware`` picks — bf16 where the CPU multiplies bf16 natively, fp32
  where it would be emulated —, AdamW on embeddings / head / norms, QK-Clip at τ = 100; DeepSeek-V3
  router-bias rule).
* **transformers** — ``model(input_ids).logits``, the same fp32 cross-entropy, ``backward()``,
  ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` step (β = (0.9, 0.95), weight decay 0.1, torch's
  default implementation for CPU tensors), ``zero_grad``.
* **k2lab (AdamW)** — rows named ``*_adamw``: the same k2lab trainer step with ``optimizer.name = "adamw"``
  (k2lab's AdamW for every parameter), against the same transformers step, so that both sides run the
  same optimizer algorithm and the ratio isolates model + trainer.

Each row runs in fp32 and, where the CPU has native bf16 (``--precision`` overrides), under bf16 autocast
(``torch.autocast("cpu", bfloat16)`` around the forward on both sides; the loss is computed in fp32).
Timing: warmup steps until the heap is steady (``timing.warm_until_steady``: ≈ 25–30 steps a side), then
``--repeats`` steps alternating k2lab / transformers (so machine noise hits both alike), median wall time
per side.
``ratio = k2lab tokens/s ÷ transformers tokens/s`` (> 1: k2lab faster).

MFU (model FLOPs utilisation) = achieved model FLOP/s ÷ this machine's measured matmul peak for the
precision used. The peak is measured in the same run (``timing.measure_peaks``): a square ``torch.mm`` of
``--peak-size`` (default 2048³, 2·n³ FLOP) in fp32 and in bf16 (256³ where bf16 is emulated), the fastest
of 5 calls, measured before and after the training rows (the larger of the two is the peak). Model FLOPs per step (forward + backward, PaLM-style,
no recomputation)::

    FLOPs = 6 · N · B·T  +  6 · L · H · (d_qk + d_v) · B·T²

``N`` = active parameters per token excluding the input-embedding lookup (attention, the dense MLP, the
router, the shared expert and top-k routed experts of every layer, and the LM head); ``B·T`` tokens;
the second term is the attention score and value matmuls, 2·T²·H·(d_qk + d_v) FLOP forward per layer and
sequence, ×3 for forward + backward — i.e. 12·L·H·((d_qk + d_v)/2)·T² per sequence, with
``d_qk = qk_nope_head_dim + qk_rope_head_dim`` (MLA's expanded per-head query/key size). Scores are
counted for all T² pairs (the causal half is not discounted, as in PaLM's formula). Optimizer FLOPs
(Newton–Schulz) are not model FLOPs and are excluded, so Muon's cost shows up as lower MFU.

Usage::

    python benchmarks/bench_train.py                 # table
    python benchmarks/bench_train.py --json          # one JSON object per line: machine, peaks, then rows
    python benchmarks/bench_train.py --smoke         # k2-nano, tiny batch, one repeat: does it still run?
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import (  # benchmarks/timing.py
    add_smoke_argument,
    alternating_medians,
    apply_smoke,
    machine_line,
    machine_report,
    measure_peaks,
)

import k2lab
from k2lab.data.packing import Batch
from k2lab.hardware import native_bf16_flags
from k2lab.hf.bridge import to_transformers
from k2lab.params import count_parameters
from k2lab.train.config import TrainConfig
from k2lab.train.trainer import Trainer


@dataclass
class Comparison:
    """One measured row: throughputs in tokens/s, ``ratio = k2lab / transformers``, MFU per side."""

    name: str
    k2lab: float
    transformers: float
    ratio: float
    k2lab_mfu: float
    transformers_mfu: float
    precision: str
    k2lab_optimizer: str
    transformers_optimizer: str
    repeats: int
    k2lab_median_s: float
    transformers_median_s: float
    model_gflop_per_step: float
    peak_tflops: float
    shape: dict[str, int]
    preset: str
    threads: int
    extra: dict[str, object] = field(default_factory=dict)


def model_flops_per_step(config: k2lab.ModelConfig, batch: int, seq: int) -> tuple[float, int]:
    """Analytic forward + backward FLOPs of one step (module docstring) and the ``N`` it used."""
    report = count_parameters(config)
    active = report.active - report.components["embedding"]
    tokens = batch * seq
    head_dims = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    attention = 6 * config.num_hidden_layers * config.num_attention_heads * head_dims * batch * seq * seq
    return 6.0 * active * tokens + attention, active


def k2lab_step(model, ids, labels, precision: str, optimizer: str, run_dir: Path) -> Callable[[], None]:
    """One ``Trainer`` step (train_step + update) on the fixed batch."""
    config = TrainConfig(
        preset=model.config.name,
        batch_size=ids.shape[0],
        seq_len=ids.shape[1],
        precision=precision,
        optimizer={"name": optimizer, "lr": 2e-3, "qk_clip_tau": 100.0},
        out=str(run_dir),
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the optimizer-grouping table; --json owns stdout
        trainer = Trainer(config, model, itertools.repeat(Batch(ids, labels)), [], run_dir)

    def step() -> None:
        _, loads = trainer.train_step()
        trainer.update(loads)
        trainer.step += 1

    return step


def transformers_step(model, ids, labels, precision: str) -> Callable[[], None]:
    """Forward, fp32 cross-entropy, backward, grad clip 1.0, ``torch.optim.AdamW`` step, zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    autocast = precision == "bf16"

    def step() -> None:
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_row(args, precision: str, optimizer: str, peaks: dict[str, float], run_dir: Path) -> Comparison:
    """Fresh models with equal weights, then alternating medians of a k2lab and a transformers step."""
    config = k2lab.load_preset(args.preset)
    ours = k2lab.build_model(config, seed=0)
    theirs = to_transformers(ours).train()
    generator = torch.Generator().manual_seed(1)
    window = torch.randint(3, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
    ids, labels = window[:, :-1].contiguous(), window[:, 1:].contiguous()
    fns = [
        k2lab_step(ours, ids, labels, precision, optimizer, run_dir),
        transformers_step(theirs, ids, labels, precision),
    ]
    t_ours, t_theirs = alternating_medians(fns, args.repeats)
    flops, active = model_flops_per_step(config, args.batch, args.seq)
    tokens = args.batch * args.seq
    peak = peaks[precision]
    suffix = "" if optimizer == "muonclip" else f"_{optimizer}"
    return Comparison(
        name=f"train_step_{precision}{suffix}_tokens_per_s",
        k2lab=round(tokens / t_ours, 2),
        transformers=round(tokens / t_theirs, 2),
        ratio=round(t_theirs / t_ours, 3),
        k2lab_mfu=round(flops / t_ours / peak, 4),
        transformers_mfu=round(flops / t_theirs / peak, 4),
        precision=precision,
        k2lab_optimizer=optimizer,
        transformers_optimizer="torch.optim.AdamW",
        repeats=args.repeats,
        k2lab_median_s=round(t_ours, 4),
        transformers_median_s=round(t_theirs, 4),
        model_gflop_per_step=round(flops / 1e9, 2),
        peak_tflops=round(peak / 1e12, 4),
        shape={"batch": args.batch, "seq": args.seq},
        preset=args.preset,
        threads=args.threads,
        extra={"active_params_excl_embedding": active},
    )


def print_table(rows: list[Comparison], peaks: dict[str, float], args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.preset} training step, batch {args.batch} × {args.seq}, {args.threads} threads, "
        f"median of {args.repeats} (ratio = k2lab / transformers tokens/s)"
    )
    headers = (
        "row",
        "k2lab optimizer",
        "k2lab tok/s",
        "transformers tok/s",
        "ratio",
        "k2lab MFU",
        "transformers MFU",
    )
    for header in headers:
        table.add_column(header, justify="left" if header in ("row", "k2lab optimizer") else "right")
    for row in rows:
        table.add_row(
            row.name.removesuffix("_tokens_per_s"),
            row.k2lab_optimizer,
            f"{row.k2lab:,.0f}",
            f"{row.transformers:,.0f}",
            f"{row.ratio:.2f}×",
            f"{row.k2lab_mfu:.1%}",
            f"{row.transformers_mfu:.1%}",
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print(
        f"{machine_line(machine_report(peaks=peaks))}; model FLOPs per step {rows[0].model_gflop_per_step} "
        "GFLOP (transformers side: torch.optim.AdamW)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k2-mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--peak-size", type=int, default=2048, help="square matmul size for the peak")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        action="append",
        help="precisions to run (default fp32, and bf16 where the CPU has native bf16)",
    )
    parser.add_argument("--no-adamw-rows", action="store_true", help="skip the k2lab-with-AdamW rows")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_smoke_argument(parser)
    args = apply_smoke(parser.parse_args(argv), preset="k2-nano", batch=2, seq=16, peak_size=128)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    precisions = args.precision or (["fp32", "bf16"] if native_bf16_flags() else ["fp32"])
    optimizers = ["muonclip"] if args.no_adamw_rows else ["muonclip", "adamw"]
    before = measure_peaks(args.peak_size)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_train.") as scratch:
        for precision in precisions:
            for optimizer in optimizers:
                rows.append(bench_row(args, precision, optimizer, before, Path(scratch)))
    after = measure_peaks(args.peak_size)
    peaks = {**before, **{key: max(before[key], after[key]) for key in ("fp32", "bf16")}}
    for row in rows:  # MFU against the higher of the two peak measurements
        scale = before[row.precision] / peaks[row.precision]
        row.k2lab_mfu = round(row.k2lab_mfu * scale, 4)
        row.transformers_mfu = round(row.transformers_mfu * scale, 4)
        row.peak_tflops = round(peaks[row.precision] / 1e12, 4)
    if args.json:
        print(json.dumps(machine_report(peaks=peaks)), flush=True)
        print(
            json.dumps(
                {
                    "name": "matmul_peak_tflops",
                    "size": args.peak_size,
                    "fp32": round(peaks["fp32"] / 1e12, 4),
                    "bf16": round(peaks["bf16"] / 1e12, 4),
                    "fp32_before_after": [round(before["fp32"] / 1e12, 4), round(after["fp32"] / 1e12, 4)],
                    "bf16_before_after": [round(before["bf16"] / 1e12, 4), round(after["bf16"] / 1e12, 4)],
                    "threads": args.threads,
                }
            ),
            flush=True,
        )
        for row in rows:
            print(json.dumps(asdict(row)), flush=True)
    else:
        print_table(rows, peaks, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
