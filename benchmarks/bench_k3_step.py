"""A K3-style training step against a K2 one: k3-mini's ``Trainer`` step ÷ k2-mini's, in one process.

Each side is one step of ``k2lab.train.trainer.Trainer`` exactly as ``k2lab train`` runs it with its
recipe (``recipes/k2-mini-demo.toml``: MuonClip, DeepSeek-V3 bias rule; ``recipes/k3-mini.toml``: MuonClip
with Per-Head Muon, Quantile Balancing, document masking), on the same random batch [batch, seq] (one
document per row), at the precision ``k2lab.hardware`` picks (``--precision`` forces one). Timing: warmup
steps until the heap is steady (``timing.warm_until_steady``: ≈ 25–30 steps; the first steps of a run
first-touch fresh memory), then ``--repeats`` steps alternating k2 / k3, medians. Rows: the full step
(``train_step`` + ``update``) and the forward + backward alone (``loss_of`` + ``backward``).
``ratio = k3 seconds ÷ k2 seconds`` (lower is better; the issue-20 target is ≤ 1.5 for the full step).
``--compile on`` compiles both sides' training forward (``k2lab.train.compile``).

Usage::

    python benchmarks/bench_k3_step.py [--json] [--repeats 5] [--precision auto|fp32|bf16] [--compile on] [--smoke]
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
from pathlib import Path

import torch
from timing import (  # benchmarks/timing.py
    add_smoke_argument,
    alternating_medians,
    apply_smoke,
    machine_line,
    run_machine_report,
)

import k2lab
from k2lab.data.packing import Batch
from k2lab.train.config import TrainConfig, load_train_config
from k2lab.train.trainer import Trainer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def trainer_config(recipe: str, args: argparse.Namespace, scratch: Path) -> TrainConfig:
    """``recipe``'s training config with this run's batch, length, precision and ``--compile``."""
    overrides = {
        "batch_size": args.batch,
        "seq_len": args.seq,
        "precision": args.precision,
        "compile": args.compile,
        "out": str(scratch),
    }
    if args.smoke:
        overrides["preset"] = args.presets[recipe]
    return load_train_config(RECIPES / recipe, **overrides)


def trainer_steps(recipe: str, args: argparse.Namespace, scratch: Path) -> tuple[Callable[[], None], ...]:
    """(full step, forward + backward) of a fresh model under ``recipe``'s optimizer and balancing."""
    config = trainer_config(recipe, args, scratch)
    model = k2lab.build_model(k2lab.load_preset(config.preset), seed=0)
    generator = torch.Generator().manual_seed(1)
    window = torch.randint(3, model.config.vocab_size, (args.batch, args.seq + 1), generator=generator)
    segments = torch.zeros(args.batch, args.seq, dtype=torch.long) if config.document_masking else None
    batch = Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous(), segments)
    with contextlib.redirect_stdout(io.StringIO()):  # the optimizer-grouping table; --json owns stdout
        trainer = Trainer(config, model, itertools.repeat(batch), [], scratch)

    def full() -> None:
        _, loads = trainer.train_step()
        trainer.update(loads)
        trainer.step += 1

    def forward_backward() -> None:
        model.train()
        loss, aux, _ = trainer.loss_of(batch)  # presets here have no MTP modules
        (loss + aux).backward()
        # what update() reads and clears every step (else the recordings grow and a compiled forward
        # meets new guards at each call)
        trainer.muonclip.qk_clip.recorded_maxima()
        for moe in trainer.lm.moe_layers():
            moe.recorded_scores.clear()
        model.zero_grad(set_to_none=True)

    return full, forward_backward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="compile both training steps (the first warmup step then includes inductor's build)",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", action="store_true", help="one JSON object per line: machine, then rows")
    add_smoke_argument(parser)
    args = parser.parse_args(argv)
    args.presets = {"k2-mini-demo.toml": "k2-nano", "k3-mini.toml": "k3-nano"}
    return apply_smoke(args, batch=2, seq=16)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = run_machine_report(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_k3_step.") as directory:
        scratch = Path(directory)
        k2 = trainer_steps("k2-mini-demo.toml", args, scratch / "k2")
        k3 = trainer_steps("k3-mini.toml", args, scratch / "k3")
        for index, name in enumerate(("full_step", "forward_backward")):
            t2, t3 = alternating_medians([k2[index], k3[index]], args.repeats)
            rows.append(
                {"name": name, "k2_s": round(t2, 4), "k3_s": round(t3, 4), "ratio": round(t3 / t2, 3)}
            )
    if args.json:
        print(json.dumps(machine))
        for row in rows:
            print(json.dumps({**row, "batch": args.batch, "seq": args.seq, "repeats": args.repeats}))
        return 0
    print(machine_line(machine))
    for row in rows:
        print(
            f"{row['name']:<17} k2-mini {row['k2_s']:.3f} s  k3-mini {row['k3_s']:.3f} s  ratio {row['ratio']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
