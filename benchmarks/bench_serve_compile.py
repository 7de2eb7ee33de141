"""Serving on a CPU with the decode step built in the background (``k2lab serve``'s default) against eager.

``--requests`` N greedy chat requests (random prompts of ``--prompt`` tokens, ``--max-tokens`` each) arrive at
once at the continuous-batching engine (``max_batch`` = N, no prefix cache). First the engine with
``background_compile`` starts and rounds of the N requests are served while its thread builds the compiled
step (the build's wall time and the eager throughput meanwhile); then, the step built, an eager engine and a
compiled one alternate (the compiled engine takes the step the build left on the model, as the first engine
does once it switched), medians of ``--repeats``. Throughput = completion tokens / wall time;
``same_replies``: how many of the compiled engine's replies match the eager engine's. The compiled step reads
its matrices in ``--decode-weights`` (auto: bf16 where the CPU runs bf16 natively), the eager one the model's
fp32 weights, so with bf16 a near-tie can go the other way; ``--decode-weights fp32`` compares like with like.
Run it with an empty ``TORCHINDUCTOR_CACHE_DIR`` for a cold build.

    python benchmarks/bench_serve_compile.py --json               # k2-mini (random weights), N = 8
    python benchmarks/bench_serve_compile.py --model runs/demo-mtp/model --requests 1,4,8
    python benchmarks/bench_serve_compile.py --smoke              # k2-nano, N = 1, one repeat
"""

from __future__ import annotations

import argparse
import time

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
from k2lab.infer.decode_weights import decode_weights_choice
from k2lab.model_dir import load_model
from k2lab.serve import Engine


def _engine(model: torch.nn.Module, max_batch: int, args: argparse.Namespace, **decode: object) -> Engine:
    """A started engine without a prefix cache, its compiled step's weights and its threads per ``args``;
    ``decode``: how it decodes (``compile=…`` or ``background_compile=True``)."""
    return Engine(
        model, max_batch, 0, decode_weights=args.decode_weights, threads=args.engine_threads, **decode
    ).start()


def during_build(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Serve rounds of ``prompts`` with a background-compiling engine until its step is built: the build's
    seconds, the rounds' median throughput and the replies of the first round."""
    start = time.perf_counter()
    engine = _engine(model, len(prompts), args, background_compile=True)
    seconds, first = [], None
    while not seconds or engine.decode_report()["build"] in ("waiting", "building"):  # one round at least
        took, replies = serve_concurrently(engine, prompts, args.max_tokens, shutdown=False)
        seconds.append(took)
        first = first or replies
    report = engine.decode_report()
    engine.shutdown()
    if report["build"] != "compiled":
        raise SystemExit(f"the background build did not finish: {report}")
    tokens = len(prompts) * args.max_tokens
    return {
        "build_s": round(time.perf_counter() - start, 1),
        "rounds_during_build": len(seconds),
        "eager_tokens_per_s_during_build": round(tokens / sorted(seconds)[len(seconds) // 2], 1),
        "replies": first,
    }


def measure(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """One row: the background build, then eager against compiled serving, alternating."""
    building = during_build(model, prompts, args)

    def serve(compile: str) -> tuple[float, list[list[int]], None]:
        engine = _engine(model, len(prompts), args, compile=compile)
        return (*serve_concurrently(engine, prompts, args.max_tokens), None)

    sides = {"eager": lambda: serve("off"), "compiled": lambda: serve("on")}
    median, replies, _ = serve_sides(sides, args.repeats)
    return {
        "name": "background_compile_serve",
        "requests": len(prompts),
        "max_tokens": args.max_tokens,
        "build_s": building["build_s"],
        "rounds_during_build": building["rounds_during_build"],
        "eager_tokens_per_s_during_build": building["eager_tokens_per_s_during_build"],
        **side_rates(median, len(prompts) * args.max_tokens, "eager", "compiled"),
        "same_replies": sum(a == b for a, b in zip(replies["eager"], replies["compiled"], strict=True)),
        "eager_same_during_build": replies["eager"] == building["replies"],
        "decode_weights": decode_weights_choice(args.decode_weights, "cpu", compiled=True).name,
        "threads": args.engine_threads,
    }


def describe(row: dict) -> str:
    """A row as a line of the plain-text report."""
    return (
        f"{row['requests']} chats: build {row['build_s']} s (eager meanwhile "
        f"{row['eager_tokens_per_s_during_build']} tok/s over {row['rounds_during_build']} rounds); then "
        f"eager {row['eager_tokens_per_s']} tok/s, compiled {row['compiled_tokens_per_s']} tok/s: "
        f"{row['ratio']}x; compiled replies equal to eager: {row['same_replies']} of {row['requests']} "
        f"(compiled step's weights {row['decode_weights']}, eager fp32)"
        + ("" if row["eager_same_during_build"] else "; the eager replies differ from the first round's!")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: --preset, random weights)")
    parser.add_argument("--preset", default="k2-mini")
    parser.add_argument("--requests", default="8", help="concurrent requests per row (comma-separated)")
    parser.add_argument("--prompt", type=int, default=64, help="tokens in each prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--decode-weights",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="matrices of the compiled step (k2lab.infer.decode_weights); fp32 to compare replies like with like",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    add_smoke_argument(parser)
    args = apply_smoke(
        parser.parse_args(), preset="k2-nano", model=None, requests="1", prompt=8, max_tokens=4
    )
    serving_threads(args)  # as k2lab serve: one OpenMP team, the engine's
    torch.manual_seed(0)
    model = (load_model(args.model) if args.model else build_model(load_preset(args.preset))).eval()
    generator = torch.Generator().manual_seed(1)
    counts = [int(n) for n in args.requests.split(",")]
    pool = torch.randint(3, model.config.vocab_size, (max(counts), args.prompt), generator=generator).tolist()
    rows = [measure(model, pool[:n], args) for n in counts]
    print_report(rows, run_machine_report(args), args.json, describe)


if __name__ == "__main__":
    main()
