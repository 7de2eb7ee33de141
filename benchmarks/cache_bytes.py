"""Decode-cache bytes per sequence against context length, read off the real cache structures.

``LatentCache`` is built on the meta device for each preset (no memory is allocated, even for K3), so the
bytes are what its tensors would hold: MLA latent rows grow with the context, KDA states do not. For the
mini presets the same figure is checked against a cache actually allocated on the CPU.

    python benchmarks/cache_bytes.py [--png cache_bytes.png] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from k2lab import load_preset
from k2lab.infer import LatentCache

CONTEXTS = (1024, 4096, 16384, 65536, 262144, 1048576)
PRESETS = ("k2", "k3", "kimi-linear-48b-a3b")


def cache_bytes(preset: str, context: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one sequence's decode cache holds at ``context`` tokens (latent rows in ``dtype``, KDA
    recurrent states fp32), from a meta-device ``LatentCache`` of exactly that length."""
    cache = LatentCache(load_preset(preset), 1, context, dtype=dtype, device="meta")
    return cache.nbytes()


def check_against_allocated(preset: str, context: int = 512) -> None:
    """The meta-device figure equals the bytes of a cache allocated on the CPU (mini presets)."""
    real = LatentCache(load_preset(preset), 1, context, dtype=torch.bfloat16)
    tensors = [real.rows, *(t for state in real.kda_states.values() for t in (state.conv, state.recurrent))]
    allocated = sum(t.untyped_storage().nbytes() for t in tensors)
    if allocated != cache_bytes(preset, context):
        raise AssertionError(
            f"{preset}: meta estimate {cache_bytes(preset, context)} != allocated {allocated}"
        )


def curves(presets=PRESETS, contexts=CONTEXTS) -> dict[str, list[int]]:
    return {preset: [cache_bytes(preset, n) for n in contexts] for preset in presets}


def plot(data: dict[str, list[int]], contexts, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from k2lab.fsutil import save_figure_atomically

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for preset, values in data.items():
        axis.plot(contexts, [v / 2**30 for v in values], marker="o", label=preset)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("context length (tokens)")
    axis.set_ylabel("decode cache per sequence (GiB, bf16 latents)")
    axis.set_title("Decode-cache bytes: MLA latents grow, KDA states stay fixed")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    save_figure_atomically(figure, Path(path))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--png", default="cache_bytes.png")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="two short contexts (the suite runs this)")
    args = parser.parse_args()
    contexts = CONTEXTS[:2] if args.smoke else CONTEXTS
    for preset in ("k2-mini", "k3-mini"):
        check_against_allocated(preset)
    data = curves(contexts=contexts)
    if args.json:
        print(json.dumps({"contexts": list(contexts), "bytes": data}, indent=2))
    else:
        for preset, values in data.items():
            cells = "  ".join(f"{n:>8}: {v / 2**20:10.1f} MiB" for n, v in zip(contexts, values, strict=True))
            print(f"{preset:<22} {cells}")
    plot(data, contexts, args.png)
    print(f"plot: {args.png}")


if __name__ == "__main__":
    main()
