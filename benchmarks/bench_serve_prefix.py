"""Serving throughput with and without the automatic prefix cache: concurrent chats sharing a system prompt.

Issue 22's case: ``--requests`` (50) chat requests arrive at once at the continuous-batching engine of
``k2lab serve``, all opening with the same ``--shared`` tokens (system prompt and tool declarations, ~500
tokens) and each with its own ``--user`` tokens, greedy, ``--max-tokens`` each (no stop token, so both
sides generate exactly as much). A fresh engine per run (a cold cache: the shared prefix is prefilled once
within the run); the sides alternate, medians of ``--repeats``. Throughput = completion tokens / wall time.

    python benchmarks/bench_serve_prefix.py --json     # k2-mini (random weights), 50 requests
    python benchmarks/bench_serve_prefix.py --smoke    # k2-nano, 6 requests, one repeat

One JSON line per table row (``--json``): the row ``prefix_cache_serve`` (both sides' seconds and tokens/s,
their ratio, whether every reply was identical, the cache's counters) and the machine.
"""

from __future__ import annotations

import argparse

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
from k2lab.serve import Engine


def chats(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``requests`` prompts: the shared prefix, then each request's own tokens."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (args.shared,), generator=g).tolist()
    return [
        shared + torch.randint(3, vocab, (args.user,), generator=g).tolist() for _ in range(args.requests)
    ]


def serve_all(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace, cache: int):
    """(seconds, replies, cache counters) for every prompt submitted at once to a fresh engine."""
    engine = Engine(model, args.max_batch, cache, args.block_size, threads=args.engine_threads).start()
    seconds, replies = serve_concurrently(engine, prompts, args.max_tokens)
    stats = engine.prefix_cache.stats() if engine.prefix_cache is not None else None
    return seconds, replies, stats


def describe(row: dict) -> str:
    """The row as a line of the plain-text report."""
    return (
        f"{row['requests']} chats sharing {row['shared_tokens']} tokens: without prefix cache {row['without_s']} s "
        f"({row['without_tokens_per_s']} tok/s), with {row['with_s']} s ({row['with_tokens_per_s']} tok/s): "
        f"{row['ratio']}x; identical replies: {row['identical_replies']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--shared", type=int, default=512, help="system prompt + tool list tokens")
    parser.add_argument("--user", type=int, default=24, help="each request's own tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--preset", default="k2-mini")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_smoke_argument(parser)
    tiny = dict(preset="k2-nano", requests=6, shared=40, user=4, max_tokens=4, max_batch=4, block_size=8)
    args = apply_smoke(parser.parse_args(), **tiny)
    serving_threads(args)  # as k2lab serve: one OpenMP team, the engine's
    torch.manual_seed(0)
    model = build_model(load_preset(args.preset)).eval()
    prompts = chats(args, model.config.vocab_size)

    serve_all(model, prompts[:2], args, 0)  # warm-up
    caches = {"without": 0, "with": args.cache_mb << 20}
    runs = {side: (lambda c=c: serve_all(model, prompts, args, c)) for side, c in caches.items()}
    median, replies, counters = serve_sides(runs, args.repeats)
    tokens = args.requests * args.max_tokens
    row = {
        "name": "prefix_cache_serve",
        "requests": args.requests,
        "shared_tokens": args.shared,
        "user_tokens": args.user,
        "max_tokens": args.max_tokens,
        "max_batch": args.max_batch,
        "without_s": round(median["without"], 3),
        "with_s": round(median["with"], 3),
        **side_rates(median, tokens, "without", "with"),
        "identical_replies": replies["with"] == replies["without"],
        "prefix_cache": counters["with"],
        "threads": args.engine_threads,
    }
    print_report([row], run_machine_report(args), args.json, describe)


if __name__ == "__main__":
    main()
