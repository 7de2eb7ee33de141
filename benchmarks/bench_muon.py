"""k2lab Muon versus ``torch.optim.Muon`` on k2-mini's matrices, and QK-Clip's share of a training step.

Comparisons (medians of ``--repeats`` after a warmup, one process, same threads):

* ``muon_step_s`` — one optimizer step over every hidden matrix of k2-mini with fixed random gradients.
  k2lab's ``Muon`` takes the 3-D expert tensors [E, out, in] and orthogonalises them in one batched
  Newton–Schulz in the precision ``k2lab.hardware`` picks (bf16 where the CPU multiplies bf16 natively, fp32
  where bf16 would be emulated); ``torch.optim.Muon`` takes 2-D parameters only, so it gets every expert
  matrix as a separate parameter (bf16 Newton–Schulz, its only mode, whatever the CPU). Same lr, weight decay, momentum,
  Nesterov and ``match_rms_adamw`` scaling. ``ratio = torch / k2lab`` (> 1: k2lab faster).
* ``qk_clip_share`` — a full k2-mini training step (forward, backward, MuonClip step) with per-head max-logit
  recording and clipping, against the same step with both off; ``share = (with − without) / with``.

Usage::

    python benchmarks/bench_muon.py [--json] [--repeats 7] [--batch 8 --seq 256] [--muon-only] [--smoke]

The machine is shared: each row states the 1-minute load average before and after its timing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import (  # benchmarks/timing.py
    add_device_argument,
    add_smoke_argument,
    alternating_medians,
    apply_smoke,
    machine_line,
    run_machine_report,
    synced,
)

import k2lab
from k2lab.optim import Muon, MuonClip, OptimizerConfig
from k2lab.optim.grouping import parameter_groups


def muon_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    groups = parameter_groups(model, OptimizerConfig())
    return [p for g in groups if g["kind"] == "muon" for p in g["params"]]


def bench_muon_step(args: argparse.Namespace) -> dict:
    model = k2lab.build_model(k2lab.load_preset(args.preset))
    ours = [torch.nn.Parameter(p.detach().clone().to(args.device)) for p in muon_matrices(model)]
    generator = torch.Generator().manual_seed(0)
    for p in ours:
        p.grad = torch.randn(p.shape, generator=generator).to(args.device)

    def as_matrices(tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(tensor.unbind(0)) if tensor.ndim == 3 else [tensor]

    theirs = []
    for p in ours:
        for weight, grad in zip(as_matrices(p.detach()), as_matrices(p.grad), strict=True):
            theirs.append(torch.nn.Parameter(weight.clone()))
            theirs[-1].grad = grad.clone()
    kwargs = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    our_opt, torch_opt = Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    load_before = os.getloadavg()[0]
    t_ours, t_torch = alternating_medians(
        [synced(our_opt.step, args.device), synced(torch_opt.step, args.device)], args.repeats
    )
    return {
        "name": "muon_step_s",
        "k2lab": t_ours,
        "torch": t_torch,
        "ratio": t_torch / t_ours,
        "k2lab_ns_dtype": str(our_opt.param_groups[0]["ns_dtype"]).removeprefix("torch."),
        "k2lab_tensors": len(ours),
        "torch_tensors": len(theirs),
        "parameters": sum(p.numel() for p in ours),
        "repeats": args.repeats,
        "load_average": [load_before, os.getloadavg()[0]],
    }


def bench_qk_clip_share(args: argparse.Namespace) -> dict:
    config = k2lab.load_preset(args.preset)
    ids = torch.randint(
        3, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)
    )

    def make_step(clip: bool) -> Callable[[], None]:
        model = k2lab.build_model(config)
        optimizer = MuonClip(model, OptimizerConfig(name="muonclip" if clip else "muon"), verbose=False)
        optimizer.qk_clip.record(clip)
        if not clip:
            nothing = [torch.zeros(1) for _ in optimizer.qk_clip.layer_indices]  # nothing recorded or clipped
            optimizer.qk_clip.recorded_maxima = lambda: nothing

        def step() -> None:
            logits = model(ids[:, :-1]).logits
            F.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        return step

    with_clip, without = alternating_medians([make_step(True), make_step(False)], args.repeats)
    return {
        "name": "qk_clip_share",
        "step_with_qk_clip_s": with_clip,
        "step_without_s": without,
        "share": (with_clip - without) / with_clip,
        "shape": {"batch": args.batch, "seq": args.seq},
        "repeats": args.repeats,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k2-mini")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true", help="one JSON object per comparison and line")
    parser.add_argument(
        "--muon-only", action="store_true", help="skip the QK-Clip share (full training steps)"
    )
    add_device_argument(parser, "where the Muon step runs (cuda: implies --muon-only)")
    add_smoke_argument(parser)
    return apply_smoke(parser.parse_args(argv), preset="k2-nano", batch=2, seq=16)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = run_machine_report(args)
    if args.device == "cuda":
        args.muon_only = True  # the QK-Clip share is a CPU training step
    rows = [bench_muon_step(args)] + ([] if args.muon_only else [bench_qk_clip_share(args)])
    if args.json:
        print(json.dumps(machine), flush=True)
    for row in rows:
        row["threads"] = args.threads
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        step, clips = rows[0], rows[1:]
        print(machine_line(machine))
        print(
            f"Muon step on {args.preset}: k2lab {step['k2lab'] * 1e3:.1f} ms ({step['k2lab_tensors']} tensors, "
            f"{step['k2lab_ns_dtype']} Newton–Schulz), "
            f"torch.optim.Muon {step['torch'] * 1e3:.1f} ms ({step['torch_tensors']} tensors, bf16): "
            f"k2lab {step['ratio']:.2f}x faster (load average {step['load_average'][0]:.2f} -> "
            f"{step['load_average'][1]:.2f})"
        )
        for clip in clips:
            print(
                f"QK-Clip share of a training step: {clip['share']:.1%} "
                f"({clip['step_with_qk_clip_s'] * 1e3:.0f} ms with, {clip['step_without_s'] * 1e3:.0f} ms without)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
