"""The RL stage of ``k2lab recipe agentic-mini``: rollouts that drop finished rows against the full batch.

Both sides run ``run_rl`` exactly as the recipe's ``stage_rl`` does (``rl_config``, ``RecipeToolTasks`` with the
recipe's no-tool share and partial credit, the same seeds), for ``--iterations`` iterations from ``--model``
(the recipe's SFT model directory, with tokenizer.json), in one process, interleaved ``--repeats`` times:

* ``full`` — ``RLConfig.drop_finished = False``: every batched ``generate`` call decodes all its rows until
  the longest one ends (a turn that closed after 20 tokens still costs 128 decode rows when another row of
  its call runs to ``max_new_tokens``);
* ``drop`` — ``drop_finished = True`` (the default): a row leaves the batch when it samples ``<|im_end|>``.

The script prints each run's wall time, its rollout share (``rollout_seconds`` of the metrics) and the rest
(scoring, update, checkpoint), the median of each side, ``ratio = full / drop`` (the speed-up), and whether
the two sides logged the same metrics (every metrics.jsonl field but the wall times): the rows of a smaller
batch round differently, so a sampled token may in principle flip; the line says where if one did.

Usage::

    python benchmarks/bench_agentic_rl.py --model runs/agentic-mini/sft/model --iterations 12 --repeats 2
    python benchmarks/bench_agentic_rl.py --smoke      # random k2-nano, small tokenizer, one iteration
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from timing import add_smoke_argument, apply_smoke, machine_line, run_machine_report  # benchmarks/timing.py

from k2lab.agentic.recipe.mini import RecipeConfig, RecipeToolTasks, rl_config
from k2lab.agentic.rl.trainer import run_rl

TIMES = ("seconds", "rollout_seconds")
SIDES = {"full": False, "drop": True}


def run_stage(args: argparse.Namespace, drop: bool, out: Path) -> dict[str, Any]:
    """One RL stage (``stage_rl``'s settings, ``--iterations`` of them) into ``out``: wall times and metrics."""
    config = RecipeConfig(
        out=out,
        rl_iterations=args.iterations,
        rl_groups=args.groups,
        rl_group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns,
    )
    rl = rl_config(config).model_copy(update={"drop_finished": drop})
    env = RecipeToolTasks(config, config.rl_no_tool_fraction, config.partial_credit)
    started = time.perf_counter()
    history = run_rl(args.model, out, rl, resume=False, env=env)
    seconds = time.perf_counter() - started
    rollout = sum(h["rollout_seconds"] for h in history)
    return {
        "seconds": seconds,
        "rollout_seconds": rollout,
        "rest_seconds": seconds - rollout,
        "iteration_seconds": [h["seconds"] for h in history],
        "metrics": [{k: v for k, v in h.items() if k not in TIMES} for h in history],
    }


def first_difference(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> str | None:
    """Where two metrics logs first differ ("iteration i: key"), None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                return f"iteration {i}: {key} {x.get(key)!r} vs {y.get(key)!r}"
    return None


def smoke_model(folder: Path) -> Path:
    """A random k2-nano with a 300-token chat tokenizer, saved as a model directory (``--smoke``)."""
    from k2lab import build_model, load_preset
    from k2lab.data.corpus import load_corpus
    from k2lab.data.tokenizer import train_tokenizer
    from k2lab.model_dir import save_model

    text = 'hello there, how are you? {"city": "Paris", "unit": "celsius", "days": 3} get_weather describe '
    corpus = folder / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text(text * (20 + i))
    tokenizer = train_tokenizer(load_corpus(str(corpus)), vocab_size=300, use_cache=False)
    torch.manual_seed(0)
    model = build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=4096))
    save_model(model, folder / "model")
    tokenizer.save(folder / "model" / "tokenizer.json")
    return folder / "model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="the recipe's SFT model directory")
    parser.add_argument("--iterations", type=int, default=12, help="RL iterations (the recipe: 12)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each side")
    parser.add_argument("--groups", type=int, default=RecipeConfig().rl_groups, help="prompts per iteration")
    parser.add_argument("--group-size", type=int, default=RecipeConfig().rl_group_size)
    parser.add_argument("--max-new-tokens", type=int, default=RecipeConfig().max_new_tokens)
    parser.add_argument("--max-turns", type=int, default=RecipeConfig().max_turns)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    add_smoke_argument(parser)
    args = apply_smoke(
        parser.parse_args(), iterations=1, groups=1, group_size=2, max_new_tokens=6, max_turns=1
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        if args.smoke:
            args.model = smoke_model(Path(scratch))
        if args.model is None:
            parser.error("--model is required (the recipe's sft/model directory)")
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
        for repeat in range(args.repeats):
            for side, drop in SIDES.items():
                run = run_stage(args, drop, Path(scratch) / f"{side}-{repeat}")
                runs[side].append(run)
                print(
                    f"{side} run {repeat}: {run['seconds']:.1f} s (rollouts {run['rollout_seconds']:.1f} s, "
                    f"rest {run['rest_seconds']:.1f} s)",
                    flush=True,
                )
    report(args, runs)


def report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Medians per side, the ratio, and whether the metrics agree (across sides and repeats)."""
    medians = {
        side: {key: statistics.median(r[key] for r in rows) for key in ("seconds", "rollout_seconds")}
        for side, rows in runs.items()
    }
    logs = [r["metrics"] for rows in runs.values() for r in rows]
    differences = [d for d in (first_difference(logs[0], log) for log in logs[1:]) if d]
    row = {
        "name": "agentic_rl_stage",
        "iterations": args.iterations,
        "repeats": args.repeats,
        **{f"{side}_s": round(m["seconds"], 2) for side, m in medians.items()},
        **{f"{side}_rollout_s": round(m["rollout_seconds"], 2) for side, m in medians.items()},
        "ratio": round(medians["full"]["seconds"] / medians["drop"]["seconds"], 3),
        "rollout_ratio": round(medians["full"]["rollout_seconds"] / medians["drop"]["rollout_seconds"], 3),
        **{f"{side}_iteration_s": [r["iteration_seconds"] for r in rows] for side, rows in runs.items()},
        "same_metrics": not differences,
        "first_difference": differences[0] if differences else None,
    }
    machine = run_machine_report(args)
    if args.json:
        print(json.dumps(machine))
        print(json.dumps(row))
        return
    print(machine_line(machine))
    print(
        f"RL stage, {args.iterations} iterations, median of {args.repeats}: full {row['full_s']} s, "
        f"drop {row['drop_s']} s, ratio {row['ratio']}x (rollouts {row['rollout_ratio']}x); "
        f"metrics identical: {row['same_metrics']}" + (f" ({row['first_difference']})" if differences else "")
    )


if __name__ == "__main__":
    main()
