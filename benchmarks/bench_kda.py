"""Kimi Delta Attention: k2lab's chunked (WY) and recurrent forms against flash-linear-attention's naive
references (``fla/ops/kda/naive.py``: ``naive_chunk_kda``, ``naive_recurrent_kda``); with ``--device cuda``
also fla's triton kernel (``fla_kernel``), all on one GPU.

For each sequence length T, medians of ``--repeats`` interleaved calls after a warmup (benchmarks/timing.py),
one process, ``--threads`` intra-op threads (default 2):

* ``forward`` — outputs only, under ``torch.no_grad()`` (prefill / inference);
* ``fwd+bwd`` — forward, then ``o.sum().backward()`` into q, k, v, g, beta.

``k2lab_chunk`` runs its hand-written backward (``k2lab.ops.kda_backward``, the default);
``k2lab_chunk_autograd`` is the same chunk form with autograd through its ops (``backward="autograd"``, the
reference tier), timed in ``fwd+bwd`` only (without gradients the two are the same code).

Shape B=1, H=HV=4, K=V=64; q, k L2-normalised, v ~ N(0, 1), beta = sigmoid(N), g a log-decay (``--gate``).
``ratio`` columns are ``other / k2lab chunk`` (> 1: the chunked form is faster). The forms that loop in
Python over tokens (both recurrent forms) or over chunk columns (fla's naive chunk form) run only up to
``--loop-max-t`` (default 4096); beyond it they are reported as skipped, with the time per call their last
measurement projects.

Timing is wall-clock: on a machine whose cores are shared with other jobs, a second intra-op thread that
loses its core stalls every parallel operation, so compare runs made under the same load (or ``--threads 1``).

Usage::

    python benchmarks/bench_kda.py [--json] [--lengths 1024 4096 16384] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import cache_bytes  # benchmarks/cache_bytes.py
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

from k2lab.ops.kda import chunk_kda, kda, recurrent_kda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fla_naive import load_naive  # noqa: E402 - fla's naive.py is importable only by file path

MODES = ("forward", "fwd+bwd")

KdaFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def implementations(device: str = "cpu") -> dict[str, KdaFn]:
    """The forms timed; on CUDA also ``fla_kernel``: fla's triton ``chunk_kda`` (``k2lab.ops.kda.kda``'s
    ``backend="fla"``, what the model runs there)."""
    naive = load_naive("kda")
    fns = {
        "k2lab_chunk": chunk_kda,
        "k2lab_chunk_autograd": functools.partial(chunk_kda, backward="autograd"),
        "k2lab_recurrent": recurrent_kda,
        "fla_naive_chunk": naive.naive_chunk_kda,
        "fla_naive_recurrent": naive.naive_recurrent_kda,
    }
    if device == "cuda":
        fns["fla_kernel"] = functools.partial(kda, backend="fla")
    return fns


def make_inputs(args: argparse.Namespace, T: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(T)
    B, H, D = 1, args.heads, args.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(args.device)

    x = randn(B, T, H, D)
    g = {
        "softplus": -F.softplus(x),  # Kimi Linear's gate at A = 1
        "lower_bound": -5 * torch.sigmoid(x),  # K3's lower-bounded gate
        "strong": -math.exp(2) * F.softplus(x + 2),
    }[args.gate]
    return {
        "q": F.normalize(randn(B, T, H, D), dim=-1),
        "k": F.normalize(randn(B, T, H, D), dim=-1),
        "v": randn(B, T, H, D),
        "g": g,
        "beta": torch.sigmoid(randn(B, T, H)),
    }


def runner(fn: KdaFn, inputs: dict[str, torch.Tensor], mode: str) -> Callable[[], None]:
    if mode == "forward":

        def forward() -> None:
            with torch.no_grad():
                fn(**inputs)

        return forward
    leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}

    def forward_backward() -> None:
        for t in leaves.values():
            t.grad = None
        o, _ = fn(**leaves)
        o.sum().backward()

    return forward_backward


def bench_length(
    args: argparse.Namespace,
    fns: dict[str, KdaFn],
    T: int,
    previous: dict[tuple[str, str], tuple[int, float]],
) -> list[dict]:
    """One row per mode at length T; ``previous`` holds each (implementation, mode)'s last (T, seconds)."""
    inputs = make_inputs(args, T)
    rows = []
    for mode in MODES:
        timed, skipped = [], {}
        for name in fns:
            if name == "k2lab_chunk_autograd" and mode == "forward":
                skipped[name] = "forward without gradients is k2lab_chunk's code"
                continue
            if name.startswith("k2lab_chunk") or name == "fla_kernel" or args.loop_max_t >= T:
                timed.append(name)
                continue
            last = previous.get((name, mode))
            projected = (
                "" if last is None else f", about {last[1] * T / last[0]:.1f} s per call projected linearly"
            )
            skipped[name] = (
                f"T > --loop-max-t {args.loop_max_t} (a Python loop over tokens or columns{projected})"
            )
        times = alternating_medians(
            [synced(runner(fns[name], inputs, mode), args.device) for name in timed], args.repeats
        )
        seconds = dict(zip(timed, times, strict=True))
        for name, t in seconds.items():
            previous[(name, mode)] = (T, t)
        ours = seconds["k2lab_chunk"]
        rows.append(
            {
                "T": T,
                "mode": mode,
                "seconds": seconds,
                "ratio": {name: t / ours for name, t in seconds.items() if name != "k2lab_chunk"},
                "skipped": skipped,
            }
        )
    return rows


def decode_cache_bytes(png: str | None) -> dict:
    """Decode-cache bytes per sequence against context length for the k2, k3 and Kimi Linear presets, read
    off meta-device ``LatentCache`` structures (checked against allocated caches of the mini presets):
    MLA latent rows grow with the context, KDA states do not (``benchmarks/cache_bytes.py``)."""
    for preset in ("k2-mini", "k3-mini"):
        cache_bytes.check_against_allocated(preset)
    data = cache_bytes.curves()
    if png:
        cache_bytes.plot(data, cache_bytes.CONTEXTS, png)
    return {"contexts": list(cache_bytes.CONTEXTS), "bytes": data, "png": png}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--gate", choices=["softplus", "lower_bound", "strong"], default="softplus")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cache-png", default="kda_cache_bytes.png", help="plot of decode-cache bytes vs context length"
    )
    parser.add_argument("--threads", type=int, default=2)
    add_device_argument(parser, "cuda: one GPU, with fla's kernel as a side")
    parser.add_argument(
        "--loop-max-t",
        type=int,
        default=4096,
        help="longest T for the loop-based forms (all but the k2lab_chunk rows)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_smoke_argument(parser)
    tiny = dict(lengths=[64], heads=2, head_dim=16, loop_max_t=64)
    return apply_smoke(parser.parse_args(argv), **tiny)


def print_table(rows: list[dict], names: list[str]) -> None:
    others = names[1:]
    header = f"{'T':>6} {'mode':<8} " + " ".join(f"{name:>20}" for name in names)
    print(header + "   ratios other / k2lab_chunk (" + ", ".join(others) + ")")
    for row in rows:
        cells = []
        for name in names:
            t = row["seconds"].get(name)
            cells.append(f"{'skipped':>20}" if t is None else f"{t * 1e3:>17.1f} ms")
        ratios = ", ".join(
            "-" if name not in row["ratio"] else f"{row['ratio'][name]:.1f}x" for name in others
        )
        print(f"{row['T']:>6} {row['mode']:<8} " + " ".join(cells) + f"   {ratios}")
    for row in rows:
        for name, why in row["skipped"].items():
            print(f"skipped {name} at T={row['T']} {row['mode']}: {why}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    fns = implementations(args.device)
    previous: dict[tuple[str, str], tuple[int, float]] = {}
    load_before = os.getloadavg()[0]
    machine = run_machine_report(args)
    rows = [row for T in sorted(args.lengths) for row in bench_length(args, fns, T, previous)]
    load = {"before": load_before, "after": os.getloadavg()[0], "cpus": os.cpu_count()}
    if args.json:
        report = {
            "name": f"kda_{args.device}",
            "machine": machine,
            "threads": args.threads,
            "shape": {"B": 1, "H": args.heads, "HV": args.heads, "K": args.head_dim, "V": args.head_dim},
            "gate": args.gate,
            "repeats": args.repeats,
            "load_average_1min": load,
            "rows": rows,
            "decode_cache": decode_cache_bytes(args.cache_png),
        }
        print(json.dumps(report))
    else:
        print(
            f"KDA on {args.device}, {args.threads} threads, B=1 H=HV={args.heads} K=V={args.head_dim}, gate {args.gate}, "
            f"median of {args.repeats}; 1-min load average {load['before']:.1f} before, {load['after']:.1f} after "
            f"on {load['cpus']} CPUs"
        )
        print(machine_line(machine))
        print_table(rows, list(fns))
        cache = decode_cache_bytes(args.cache_png)
        print("decode cache per sequence (MiB, bf16 latents + fp32 KDA states):")
        for preset, values in cache["bytes"].items():
            cells = "  ".join(
                f"{n}: {v / 2**20:,.0f}" for n, v in zip(cache["contexts"], values, strict=True)
            )
            print(f"  {preset:<20} {cells}")
        print(f"plot: {args.cache_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
