"""k2lab versus transformers' ``DeepseekV3ForCausalLM`` on the same K2 model, CPU, one process.

Both models hold exactly the same weights (``k2lab.hf.bridge.to_transformers``) and run under the same
``torch.set_num_threads``. Each comparison runs warmup calls until the heap is steady
(``timing.warm_until_steady``), then ``--repeats`` timed calls, and reports
the median wall time as a throughput (higher is better) and ``ratio = k2lab / transformers``.

Comparisons:

* ``forward_backward_tokens_per_s`` — one training step without the optimizer: the forward, fp32
  cross-entropy against the next tokens (labels shifted, last position ignored), ``loss.backward()``
  (gradients cleared before each call), both sides under the same ``--precision`` (``auto``: what
  ``k2lab.hardware`` picks for this CPU — bf16 autocast where bf16 is native, fp32 where it is emulated).
  transformers: ``logits = model(ids)`` and ``F.cross_entropy``; k2lab: ``model(ids, labels=labels).loss``
  (head and loss fused). A third side, timed in the same rotation, runs k2lab the transformers way
  (``unfused_loss_tok_s`` in the notes). Throughput is ``batch × seq / seconds``. Default: batch 8 × seq 256.
* ``greedy_decode_tokens_per_s`` — greedy generation of ``--new-tokens`` tokens per prompt, prefill included:
  ``k2lab.infer.generate`` (latent MLA cache, absorbed decode) versus ``model.generate(do_sample=False)``
  with transformers' default ``DynamicCache``. EOS is disabled on both sides so every sequence produces all
  tokens; throughput is ``batch × new_tokens / seconds``. Default: batch 4, prompt 64, 64 new tokens;
  ``--decode-batch 4 1`` adds a ``greedy_decode_b1_tokens_per_s`` row (each batch after the first is named
  by its size). ``--compile-decode`` runs k2lab's side with the compiled decode step (``k2lab.infer.compiled``;
  its build happens in the warm-up, outside the timings); in the speculative rows the target's verify
  forward, the draft's forwards (``Draft.compile``) and plain decoding then run compiled. (``k2lab generate``
  and ``serve`` leave a draft unused by default in that setting on CPU: ``speculation_decision``.)
  With ``--compile-decode`` the compiled step reads its matrices in the dtype ``--decode-weights`` resolves to
  (``auto``: ``k2lab.infer.decode_weights.decode_weights_choice``; bf16 where the CPU runs bf16 natively);
  when that is bf16 the transformers side decodes a bf16 copy of its model (weights and activations in bf16,
  its own way of decoding bf16 weights), so both read bf16 weights. ``--decode-weights fp32`` keeps both fp32.
  The script checks that both sides generate identical tokens and warns if they do not (with bf16 weights
  the two round differently, so the tokens may part).
  A second row repeats it after a ``--long-prompt`` (default 1024) prompt: transformers re-expands every cached
  latent through ``kv_b_proj`` at each step, absorbed decode never does, so the gap grows with context.
* ``speculative_{greedy,sampled}_b{B}_tokens_per_s`` — k2lab against itself: ``speculative_generate`` with
  the model's EAGLE draft (``k2lab.infer.draft.find_draft``: MODEL/draft/ or its MTP layer) versus plain
  ``generate``, same prompts and ``--new-tokens``, ``speedup = speculative / plain`` (medians, interleaved).
  ``tokens_per_step`` is the mean number of tokens per target forward (accepted drafts + the target's own),
  also measured on ``--spec-eval`` held-out prompts in one batch (``held_out_tokens_per_step``). With
  ``--spec-model DIR`` (a trained model directory with its tokenizer.json) the prompts are windows of the
  corpus's validation files (``--spec-data``, default the embedded corpus); without it, an untrained
  k2-mini with one MTP layer and random prompts (acceptance near zero: the overhead of a useless draft).

Usage::

    python benchmarks/bench_k2_model.py                      # table
    python benchmarks/bench_k2_model.py --json --threads 2   # one JSON object per comparison and line
    python benchmarks/bench_k2_model.py --precision fp32     # force a precision (default auto)
    python benchmarks/bench_k2_model.py --smoke              # k2-nano, tiny shapes, one repeat
    python benchmarks/bench_k2_model.py --only speculative --spec-model runs/demo-mtp/model --json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import warnings
import weakref
from dataclasses import asdict, dataclass, field

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
from k2lab.data import load_tokenizer
from k2lab.data.corpus import load_corpus
from k2lab.hardware import Choice, choose
from k2lab.hf.bridge import to_transformers
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.decode_weights import decode_weights_choice
from k2lab.infer.draft import EagleDraft, find_draft
from k2lab.infer.speculative import speculative_generate
from k2lab.model_dir import load_model
from k2lab.train.compile import compiled
from k2lab.train.draft import corpus_windows


@dataclass
class Comparison:
    """One measured row: throughputs in tokens/s, ``ratio = k2lab / transformers``."""

    name: str
    k2lab: float
    transformers: float
    ratio: float
    repeats: int
    k2lab_median_s: float
    transformers_median_s: float
    shape: dict[str, int]
    preset: str
    threads: int
    extra: dict[str, object] = field(default_factory=dict)


@dataclass
class SpeculativeRow:
    """Speculative against plain decoding, both k2lab: tokens/s, ``speedup = speculative / plain``."""

    name: str
    speculative: float
    plain: float
    speedup: float
    tokens_per_step: float
    mean_accepted: float
    held_out_tokens_per_step: float
    repeats: int
    speculative_median_s: float
    plain_median_s: float
    shape: dict[str, int]
    preset: str
    threads: int
    extra: dict[str, object] = field(default_factory=dict)


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Labels [B, T]: position t predicts token t + 1; the last position is ignored (-100)."""
    return F.pad(ids[:, 1:], (0, 1), value=-100)


def train_step(
    model: torch.nn.Module,
    ids: torch.Tensor,
    labels: torch.Tensor,
    hf: bool,
    dtype: torch.dtype,
    fused_loss: bool = True,
    forward: torch.nn.Module | None = None,
) -> None:
    """Forward, next-token cross-entropy over all B·T positions, backward; ids, labels: [B, T].

    Each side as its library trains: transformers' logits [B, T, V], then the fp32 cross-entropy its own
    causal-LM loss computes (shifted labels rather than sliced logits, so no copies of the logits); k2lab's
    ``model(ids, labels=labels).loss``, the head and the loss fused (``k2lab.ops.linear_cross_entropy``:
    the same products, the [B, T, V] logits never written whole). ``fused_loss=False`` runs k2lab the
    transformers way, for the fused loss's own A/B. ``forward``: what runs the model's forward (its
    compiled twin, ``--compile-train``), ``model`` by default.
    """
    model.zero_grad(set_to_none=True)
    forward = model if forward is None else forward
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out = (
            model(input_ids=ids, use_cache=False)
            if hf
            else forward(ids, labels=labels if fused_loss else None)
        )
    loss = out.loss  # None without labels, on either side
    if loss is None:
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    loss.backward()


def bench_forward_backward(ours, theirs, args) -> Comparison:
    """Training tokens/s of forward + backward on a random batch [batch, seq]."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ours.config.vocab_size, (args.batch, args.seq), generator=generator)
    ids = ids.to(args.device)
    labels = next_token_labels(ids)
    ours.train()
    theirs.train()
    dtype = choose("benchmark", args.precision, args.device).dtype
    forward = compiled(ours) if args.compile_train else ours
    sides = [
        lambda: train_step(ours, ids, labels, hf=False, dtype=dtype, forward=forward),
        lambda: train_step(theirs, ids, labels, hf=True, dtype=dtype),
        lambda: train_step(ours, ids, labels, hf=False, dtype=dtype, fused_loss=False, forward=forward),
    ]
    if args.compile_train:  # k2lab eager too, in the same rotation
        sides.append(lambda: train_step(ours, ids, labels, hf=False, dtype=dtype))
    t_ours, t_theirs, t_unfused, *t_eager = alternating_medians(
        [synced(side, args.device) for side in sides], args.repeats
    )
    ours.zero_grad(set_to_none=True)
    theirs.zero_grad(set_to_none=True)
    tokens = args.batch * args.seq
    return _comparison(
        "forward_backward_tokens_per_s",
        tokens,
        t_ours,
        t_theirs,
        args,
        {"batch": args.batch, "seq": args.seq},
        {
            "precision": "bf16" if dtype == torch.bfloat16 else "fp32",
            "unfused_loss_tok_s": round(tokens / t_unfused, 1),  # k2lab with logits + F.cross_entropy
            "compiled_train": args.compile_train,
            **({"eager_tok_s": round(tokens / t_eager[0], 1)} if t_eager else {}),
        },
    )


def bench_greedy_decode(
    ours, theirs, args, prompt_len: int, name: str = "greedy_decode_tokens_per_s", batch: int | None = None
) -> Comparison:
    """Greedy generation tokens/s (prefill included) from the same [batch, prompt_len] prompts."""
    batch = args.decode_batch[0] if batch is None else batch
    generator = torch.Generator().manual_seed(1)
    # Token ids >= 3 keep pad/bos/eos out of the prompts.
    ids = torch.randint(3, ours.config.vocab_size, (batch, prompt_len), generator=generator).to(args.device)
    n_new = args.new_tokens
    ours.eval()
    theirs.eval()
    theirs.generation_config.eos_token_id = None
    theirs.generation_config.pad_token_id = ours.config.pad_token_id or 0
    compile_mode = "on" if args.compile_decode else "off"
    weights = decode_weights(args)
    config = GenerationConfig(
        max_new_tokens=n_new, eos_token_id=None, compile=compile_mode, decode_weights=weights.name
    )
    prompts = ids.tolist()
    if weights.dtype == torch.bfloat16:
        theirs = bf16_peer(theirs)

    def run_ours() -> list[list[int]]:
        return generate(ours, prompts, config)

    def run_theirs() -> torch.Tensor:
        with torch.no_grad():
            out = theirs.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                eos_token_id=None,
            )
        return out[:, ids.shape[1] :]

    same = run_ours() == run_theirs().tolist()
    if not same:
        warnings.warn("greedy outputs differ between k2lab and transformers", stacklevel=1)
    t_ours, t_theirs = alternating_medians(
        [synced(run_ours, args.device), synced(run_theirs, args.device)], args.repeats
    )
    tokens = batch * n_new
    shape = {"batch": batch, "prompt": prompt_len, "new_tokens": n_new}
    extra = {
        "same_tokens": same,
        "compiled_decode": args.compile_decode,
        "decode_weights": weights.describe(),
        "peer_dtype": "bf16" if weights.dtype == torch.bfloat16 else "fp32",
    }
    return _comparison(name, tokens, t_ours, t_theirs, args, shape, extra)


# keyed by the model itself (weakly): an id() key could be reused by a later model once its first owner is freed
_BF16_PEERS: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module] = weakref.WeakKeyDictionary()


def bf16_peer(theirs: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of the transformers model (made once per model)."""
    if theirs not in _BF16_PEERS:
        _BF16_PEERS[theirs] = copy.deepcopy(theirs).to(torch.bfloat16).eval()
    return _BF16_PEERS[theirs]


def decode_weights(args: argparse.Namespace) -> Choice:
    """The dtype k2lab's decode step reads its matrices in for this run (``--decode-weights``, compiled or not)."""
    return decode_weights_choice(args.decode_weights, args.device, compiled=args.compile_decode)


def speculative_setup(args, config) -> tuple[torch.nn.Module, object, list[list[int]], str, str]:
    """(target, draft, prompts, label, draft description): a trained model directory's held-out text, or
    an untrained model with an MTP layer on random prompts."""
    count = max(args.spec_eval, *args.spec_batches)
    if args.spec_model is None:
        target = k2lab.build_model(config.replace(num_nextn_predict_layers=1), seed=0).eval().to(args.device)
        generator = torch.Generator().manual_seed(2)
        prompts = torch.randint(3, config.vocab_size, (count, args.prompt), generator=generator).tolist()
        return target, EagleDraft(target, target.mtp[0]), prompts, args.preset, "untrained MTP layer"
    target = load_model(args.spec_model).eval().to(args.device)
    draft = find_draft(args.spec_model, target)
    if draft is None:
        raise SystemExit(f"{args.spec_model} has no draft/ (k2lab draft train) and no MTP layer")
    tokenizer = load_tokenizer(f"{args.spec_model}/tokenizer.json")
    corpus = load_corpus(args.spec_data, max_bytes=2_000_000)
    texts = [document.text for document in corpus.val or corpus.train]
    prompts = corpus_windows(texts, tokenizer, count, args.prompt, random.Random(0))
    kind = "its MTP layer" if any(draft.module is module for module in target.mtp) else "MODEL/draft"
    return target, draft, prompts, str(args.spec_model), f"EAGLE draft ({kind}), held-out text"


def bench_speculative(args, config) -> list[SpeculativeRow]:
    """Speculative (k = --draft-tokens) versus plain decoding of the same prompts, greedy and sampled."""
    target, draft, prompts, label, described = speculative_setup(args, config)
    weights = decode_weights(args)  # the verify, the draft and the plain steps
    rows = []
    for temperature in (0.0, 1.0):
        generation = GenerationConfig(
            max_new_tokens=args.new_tokens,
            temperature=temperature,
            eos_token_id=None,
            compile="on" if args.compile_decode else "off",  # both sides: the verify and the plain step
            decode_weights=args.decode_weights,
        )
        _, held_out = speculative_generate(
            target, draft, prompts[: args.spec_eval], generation, args.draft_tokens
        )
        for batch in args.spec_batches:
            row = speculative_row(target, draft, prompts[:batch], generation, args)
            row.held_out_tokens_per_step = round(held_out.tokens_per_step, 3)
            row.preset = label
            row.extra = {
                "draft": described,
                "held_out_prompts": min(args.spec_eval, len(prompts)),
                "decode_weights": weights.describe(),
            }
            rows.append(row)
    return rows


def speculative_row(target, draft, prompts, generation: GenerationConfig, args) -> SpeculativeRow:
    """One batch: speculative against plain, interleaved medians; the acceptance of one speculative run."""
    k = args.draft_tokens
    plain_out = generate(target, prompts, generation)
    spec_out, stats = speculative_generate(target, draft, prompts, generation, k)
    if generation.temperature == 0 and spec_out != plain_out:
        warnings.warn("speculative greedy output differs from plain decoding", stacklevel=1)
    t_spec, t_plain = alternating_medians(
        [
            synced(lambda: speculative_generate(target, draft, prompts, generation, k), args.device),
            synced(lambda: generate(target, prompts, generation), args.device),
        ],
        args.repeats,
    )
    tokens = len(prompts) * args.new_tokens
    kind = "greedy" if generation.temperature == 0 else "sampled"
    return SpeculativeRow(
        name=f"speculative_{kind}_b{len(prompts)}_tokens_per_s",
        speculative=round(tokens / t_spec, 2),
        plain=round(tokens / t_plain, 2),
        speedup=round(t_plain / t_spec, 3),
        tokens_per_step=round(stats.tokens_per_step, 3),
        mean_accepted=round(stats.mean_accepted, 3),
        held_out_tokens_per_step=float("nan"),
        repeats=args.repeats,
        speculative_median_s=round(t_spec, 5),
        plain_median_s=round(t_plain, 5),
        shape={"batch": len(prompts), "prompt": args.prompt, "new_tokens": args.new_tokens, "k": k},
        preset="",
        threads=args.threads,
    )


def print_speculative(rows: list[SpeculativeRow]) -> None:
    for row in rows:
        print(
            f"{row.name.removesuffix('_tokens_per_s')}: {row.speculative:,.1f} vs plain {row.plain:,.1f} "
            f"tok/s = {row.speedup:.2f}x, {row.tokens_per_step:.2f} tokens/step "
            f"(held-out {row.held_out_tokens_per_step:.2f}), {row.extra['draft']}, {row.preset}"
        )


def _comparison(name, tokens, t_ours, t_theirs, args, shape, extra=None) -> Comparison:
    ours, theirs = tokens / t_ours, tokens / t_theirs
    return Comparison(
        name=name,
        k2lab=round(ours, 2),
        transformers=round(theirs, 2),
        ratio=round(ours / theirs, 3),
        repeats=args.repeats,
        k2lab_median_s=round(t_ours, 5),
        transformers_median_s=round(t_theirs, 5),
        shape=shape,
        preset=args.preset,
        threads=args.threads,
        extra=extra or {},
    )


def print_table(rows: list[Comparison]) -> None:
    """A rich table when rich is importable, plain text otherwise."""
    headers = ["comparison", "shape", "k2lab tok/s", "transformers tok/s", "ratio", "notes"]
    shapes = {row.name.removesuffix("_tokens_per_s"): "×".join(row.shape) for row in rows}
    cells = [
        [
            row.name.removesuffix("_tokens_per_s"),
            "×".join(str(value) for value in row.shape.values()),
            f"{row.k2lab:,.1f}",
            f"{row.transformers:,.1f}",
            f"{row.ratio:.2f}x",
            " ".join(f"{key}={value}" for key, value in row.extra.items()),
        ]
        for row in rows
    ]
    title = f"{rows[0].preset}, {rows[0].threads} threads, median of {rows[0].repeats} (ratio = k2lab / transformers)"
    legend = "; ".join(f"{name} shape = {shape}" for name, shape in shapes.items())
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for line in [headers, *cells]:
            print(" | ".join(line))
        print(legend)
        return
    table = Table(title=title)
    for header in headers:
        table.add_column(header, justify="right" if "tok/s" in header or header == "ratio" else "left")
    for line in cells:
        table.add_row(*line)
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print(legend)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="k2-mini")
    parser.add_argument("--batch", type=int, default=8, help="training batch")
    parser.add_argument("--seq", type=int, default=256, help="training sequence length")
    parser.add_argument(
        "--decode-batch",
        type=int,
        nargs="+",
        default=[4, 1],
        help="decode batches (the first names the rows)",
    )
    parser.add_argument("--compile-decode", action="store_true", help="k2lab decodes with the compiled step")
    parser.add_argument(
        "--compile-train",
        action="store_true",
        help="k2lab's forward+backward runs compiled (k2lab.train.compile)",
    )
    add_device_argument(parser, "where both sides run (cuda: one GPU)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length for decoding")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=1024,
        help="also decode after a prompt this long, where re-expanding cached latents costs (0 = skip)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", choices=["train", "decode", "speculative"], help="run one comparison only")
    parser.add_argument("--spec-model", help="trained model directory for the speculative rows")
    parser.add_argument("--spec-data", help="corpus whose validation files give held-out prompts")
    parser.add_argument("--spec-batches", type=int, nargs="+", default=[1, 4], help="speculative batches")
    parser.add_argument("--spec-eval", type=int, default=16, help="held-out prompts for tokens per step")
    parser.add_argument("--draft-tokens", type=int, default=4, help="k of the speculative rows")
    parser.add_argument(
        "--precision", choices=["auto", "fp32", "bf16"], default="auto", help="forward+backward precision"
    )
    parser.add_argument(
        "--decode-weights",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="matrices of k2lab's compiled decode step (k2lab.infer.decode_weights; auto: per k2lab.hardware); "
        "with bf16 the transformers side decodes a bf16 copy of its model",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per comparison and line")
    add_smoke_argument(parser)
    tiny = dict(
        preset="k2-nano",
        batch=2,
        seq=16,
        decode_batch=[2, 1],
        prompt=8,
        new_tokens=4,
        long_prompt=0,
        spec_batches=[1],
        spec_eval=2,
        draft_tokens=2,
    )
    args = apply_smoke(parser.parse_args(argv), **tiny)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = k2lab.load_preset(args.preset)
    if args.only == "speculative":
        ours = theirs = None
    else:
        ours = k2lab.build_model(config, seed=0)
        theirs = to_transformers(ours).to(args.device)
        ours.to(args.device)
    machine = run_machine_report(args)
    if args.device == "cuda":
        torch.set_float32_matmul_precision("highest")  # fp32 sides in fp32, not TF32
    rows = []
    if args.only in (None, "train"):
        rows.append(bench_forward_backward(ours, theirs, args))
    if args.only in (None, "decode"):
        rows.append(bench_greedy_decode(ours, theirs, args, args.prompt))
        for batch in args.decode_batch[1:]:
            name = f"greedy_decode_b{batch}_tokens_per_s"
            rows.append(bench_greedy_decode(ours, theirs, args, args.prompt, name, batch))
        if args.long_prompt:
            rows.append(
                bench_greedy_decode(
                    ours, theirs, args, args.long_prompt, "greedy_decode_long_prompt_tokens_per_s"
                )
            )
    speculative = bench_speculative(args, config) if args.only in (None, "speculative") else []
    if args.json:
        print(json.dumps(machine), flush=True)
        for row in [*rows, *speculative]:
            print(json.dumps(asdict(row)), flush=True)
    else:
        if rows:
            print_table(rows)
        print_speculative(speculative)
        print(machine_line(machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
