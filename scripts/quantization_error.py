"""How much a quantised export moves a trained model: MXFP4 routed experts and block-FP8, on held-out text.

    .venv/bin/python scripts/quantization_error.py /work/runs/demo-mtp/model [--windows 32 --length 128]

For each format the model can take, the model directory is written with ``k2lab.hf.to_hf(quantize=...)``, read
back with ``from_hf`` (which dequantises) and run beside the original (fp32) on the same held-out windows of
the embedded corpus's validation split. Printed per format: the held-out loss of both, the top-1 agreement of
the next-token predictions, max |Δlogit| and rms(Δlogit) / rms(logit). ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from k2lab.config import ConfigError
from k2lab.data import load_tokenizer
from k2lab.data.corpus import load_corpus
from k2lab.hf import from_hf, to_hf
from k2lab.model_dir import load_model
from k2lab.train.draft import corpus_windows

FORMATS = ("mxfp4", "fp8")


@torch.no_grad()
def _logits(model: torch.nn.Module, windows: torch.Tensor, batch: int = 8) -> torch.Tensor:
    return torch.cat([model(windows[i : i + batch]).logits.float() for i in range(0, len(windows), batch)])


def _loss(logits: torch.Tensor, windows: torch.Tensor) -> float:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()


def compare(reference: torch.Tensor, quantised: torch.Tensor, windows: torch.Tensor) -> dict[str, float]:
    """The figures of one format: losses, top-1 agreement, max and relative rms logit difference."""
    diff = quantised - reference
    return {
        "loss": _loss(reference, windows),
        "quantised_loss": _loss(quantised, windows),
        "top1_agreement": (reference.argmax(-1) == quantised.argmax(-1)).float().mean().item(),
        "max_abs_logit_diff": diff.abs().max().item(),
        "rms_rel_logit_diff": (diff.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a k2lab model directory (with tokenizer.json)")
    parser.add_argument("--windows", type=int, default=32, help="held-out windows")
    parser.add_argument("--length", type=int, default=128, help="tokens per window")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()

    model = load_model(args.model).eval()
    tokenizer = load_tokenizer(str(args.model / "tokenizer.json"))
    corpus = load_corpus(None, max_bytes=2_000_000)
    texts = [document.text for document in corpus.val or corpus.train]
    windows = torch.tensor(corpus_windows(texts, tokenizer, args.windows, args.length, random.Random(0)))
    reference = _logits(model, windows)
    rows = []
    for fmt in FORMATS:
        with tempfile.TemporaryDirectory() as folder:
            try:
                to_hf(model, Path(folder) / "export", quantize=fmt)
            except ConfigError as error:
                print(f"{fmt}: not for this model ({error})")
                continue
            quantised = _logits(from_hf(Path(folder) / "export").eval(), windows)
        row = {"format": fmt, "model": str(args.model), **compare(reference, quantised, windows)}
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
