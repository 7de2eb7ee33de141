"""Serving throughput with and without speculative decoding: concurrent chat requests to the engine.

``--requests`` N chat requests (a system prompt and a user turn holding a held-out window of the model's
validation text, rendered with K2's chat template as ``k2lab serve`` does) arrive at once at the
continuous-batching engine of ``k2lab serve`` (``max_batch`` = N), greedy (or sampled at ``--temperature``,
request i seeded i), ``--max-tokens`` each (no stop token, so both sides generate exactly as much).
Sampled requests draft as the engine decides by default (on a CPU they decode plainly), or always with
``--sampled-drafts on`` (the engine's behaviour before that rule). One side decodes plainly, the other speculates with the
draft beside the model (``MODEL/draft/`` or its MTP layer) proposing k = ``--draft-tokens`` tokens; both
keep the default prefix cache. A fresh engine per run; the sides alternate, medians of ``--repeats``.
Throughput = completion tokens / wall time; the row also gives the mean drafted tokens accepted per row and
verify step, the tokens per target forward and whether every reply was identical, and the load average.

    python benchmarks/bench_serve_speculative.py --model /tmp/spec/demo --json
    python benchmarks/bench_serve_speculative.py --model /tmp/spec/demo --temperature 1 --sampled-drafts on
    python benchmarks/bench_serve_speculative.py --smoke    # k2-nano with an untrained MTP layer
"""

from __future__ import annotations

import argparse
import os
import random

import torch
from timing import (  # benchmarks/timing.py
    add_smoke_argument,
    apply_smoke,
    print_report,
    run_machine_report,
    serve_concurrently,
    serve_sides,
    serving_threads,
    side_rates,
)

from k2lab import build_model, load_preset
from k2lab.data import load_tokenizer
from k2lab.data.corpus import load_corpus
from k2lab.infer.draft import EagleDraft, find_draft
from k2lab.model_dir import load_model
from k2lab.runtime.chat import render_chat
from k2lab.serve import Engine
from k2lab.train.draft import corpus_windows

SYSTEM = "You are a helpful assistant. Continue the user's text in the same style."


def setup(args: argparse.Namespace):
    """(target, draft, prompts): the model directory's held-out text as chats, or (smoke) k2-nano with an
    untrained MTP layer on random prompts."""
    count = max(args.requests)
    if args.model is None:
        target = build_model(load_preset(args.preset, num_nextn_predict_layers=1)).eval()
        generator = torch.Generator().manual_seed(2)
        prompts = torch.randint(3, target.config.vocab_size, (count, args.prompt), generator=generator)
        return target, EagleDraft(target, target.mtp[0]), prompts.tolist()
    target = load_model(args.model).eval()
    draft = find_draft(args.model, target)
    if draft is None:
        raise SystemExit(f"{args.model} has no draft/ (k2lab draft train) and no MTP layer")
    tokenizer = load_tokenizer(f"{args.model}/tokenizer.json")
    corpus = load_corpus(args.data, max_bytes=2_000_000)
    texts = [document.text for document in corpus.val or corpus.train]
    windows = corpus_windows(texts, tokenizer, count, args.prompt, random.Random(0))
    chats = [
        render_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": tokenizer.decode(w)}])
        for w in windows
    ]
    return target, draft, [tokenizer.encode(chat) for chat in chats]


def serve_all(model, draft, prompts: list[list[int]], args: argparse.Namespace, k: int):
    """(seconds, replies, speculation report) for every prompt submitted at once to a fresh engine."""
    sampled_drafts = True if args.sampled_drafts == "on" else None
    engine = Engine(
        model,
        len(prompts),
        compile="off",
        draft=draft,
        draft_tokens=k,
        sampled_drafts=sampled_drafts,
        threads=args.engine_threads,
    ).start()
    seconds, replies = serve_concurrently(engine, prompts, args.max_tokens, args.temperature)
    report = engine.speculation.report() if engine.speculation is not None else None
    return seconds, replies, report


def measure(model, draft, prompts, args, k: int) -> dict:
    """One row: plain against speculative serving of ``prompts``, alternating, medians of the repeats."""
    load_before = os.getloadavg()[0]
    sides = {"plain": None, "speculative": draft}
    runs = {side: (lambda d=d: serve_all(model, d, prompts, args, k)) for side, d in sides.items()}
    median, replies, reports = serve_sides(runs, args.repeats)
    report = reports["speculative"]
    tokens = len(prompts) * args.max_tokens
    return {
        "name": "speculative_serve",
        "requests": len(prompts),
        "draft_tokens": k,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "sampled_drafts": report["sampled_drafts"],
        "plain_s": round(median["plain"], 3),
        "speculative_s": round(median["speculative"], 3),
        **side_rates(median, tokens, "plain", "speculative"),
        "mean_accepted": report["mean_accepted"],
        "tokens_per_step": report["tokens_per_step"],
        "identical_replies": replies["plain"] == replies["speculative"],
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "threads": args.engine_threads,
    }


def describe(row: dict) -> str:
    """A row as a line of the plain-text report."""
    return (
        f"{row['requests']} chats (T={row['temperature']:g}, sampled drafts "
        f"{row['sampled_drafts']}), k={row['draft_tokens']}: plain {row['plain_tokens_per_s']} tok/s, "
        f"speculative {row['speculative_tokens_per_s']} tok/s: {row['ratio']}x; {row['mean_accepted']} "
        f"drafts accepted per verify step ({row['tokens_per_step']} tokens); identical replies: "
        f"{row['identical_replies']}; load {row['load_average']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="trained model directory with a draft (or MTP layer)")
    parser.add_argument("--data", default=None, help="corpus whose validation files give the user turns")
    parser.add_argument("--requests", default="1,4,8", help="concurrent requests per row (comma-separated)")
    parser.add_argument("--draft-tokens", default="3", help="k per row (comma-separated)")
    parser.add_argument("--prompt", type=int, default=64, help="held-out tokens in each user turn")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests")
    parser.add_argument(
        "--sampled-drafts",
        choices=("auto", "on"),
        default="auto",
        help="whether sampled requests draft: as the engine decides (auto), or always (on)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--preset", default="k2-nano", help="the model without --model")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_smoke_argument(parser)
    args = apply_smoke(parser.parse_args(), model=None, requests="2", prompt=8, max_tokens=6)
    args.requests = [int(n) for n in args.requests.split(",")]
    serving_threads(args)  # as k2lab serve: one OpenMP team, the engine's
    torch.manual_seed(0)
    model, draft, prompts = setup(args)
    with torch.inference_mode():
        serve_all(model, draft, prompts[:1], args, 2)  # warm-up
    rows = [
        measure(model, draft, prompts[:n], args, int(k))
        for n in args.requests
        for k in args.draft_tokens.split(",")
    ]
    print_report(rows, run_machine_report(args), args.json, describe)


if __name__ == "__main__":
    main()
