"""The RL update's scoring pass: ``k2lab.posttrain.scoring.turn_logprobs`` versus scoring every turn on its own.

Both sides compute log π(y_t | prompt, y_<t) of every completion token of multi-turn episodes and back-propagate
their sum (what one K1.5 step does), on the same random k2-mini model, in one process:

* ``per_turn`` — the straightforward pass: one right-padded row per turn (its prompt + completion), the full
  [T, V] logits, log-softmax, gather at the completion positions;
* ``k2lab`` — ``turn_logprobs``: the turns of one conversation folded into one row (``turn_rows``) and the head
  computed at the completion positions only (``CausalLM(..., logits_mask=...)``).

Synthetic episodes: ``--episodes`` conversations of ``--turns`` turns; the first prompt has ``--prompt``
tokens (tool declarations and the request), each later prompt extends the previous prompt + completion by a
``--observation``-token tool result, completions have ``--completion`` tokens — the shape of the
agentic-mini RL rollouts (~500-token prompts, 3–4 turns). The script checks that both sides give the same
log-probs, then reports the median wall time of ``--repeats`` interleaved calls and ``ratio = per_turn /
k2lab`` (the speed-up).

Usage::

    python benchmarks/bench_rl_update.py --threads 2
    python benchmarks/bench_rl_update.py --smoke      # k2-nano, two short episodes, one repeat
"""

from __future__ import annotations

import argparse
import json

import torch
from timing import (  # benchmarks/timing.py
    add_smoke_argument,
    alternating_medians,
    apply_smoke,
    run_machine_report,
)

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.rollout import Turn
from k2lab.posttrain.scoring import turn_logprobs


def synthetic_turns(args: argparse.Namespace, vocab: int) -> list[Turn]:
    """``episodes × turns`` turns; turn k + 1's prompt extends turn k's prompt + completion."""
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    turns = []
    for _ in range(args.episodes):
        prompt = tokens(args.prompt)
        for _ in range(args.turns):
            completion = tokens(args.completion)
            turns.append(Turn(prompt, completion))
            prompt = prompt + completion + tokens(args.observation)
    return turns


def per_turn_logprobs(model: torch.nn.Module, turns: list[Turn], batch: int) -> list[torch.Tensor]:
    """One row per turn, full logits."""
    out = []
    for start in range(0, len(turns), batch):
        chunk = turns[start : start + batch]
        rows = [t.prompt_ids + t.completion_ids for t in chunk]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)], valid[i, : len(row)] = torch.tensor(row), True
        logits = model(ids, attention_mask=valid).logits.float()
        logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        for i, t in enumerate(chunk):
            out.append(logp[i, len(t.prompt_ids) - 1 : len(t.prompt_ids) - 1 + len(t.completion_ids)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=480)
    parser.add_argument("--observation", type=int, default=40)
    parser.add_argument("--completion", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--preset", default="k2-mini")
    add_smoke_argument(parser)
    tiny = dict(preset="k2-nano", episodes=2, turns=2, prompt=12, observation=4, completion=4, batch=2)
    args = apply_smoke(parser.parse_args(), **tiny)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(load_preset(args.preset))
    turns = synthetic_turns(args, model.config.vocab_size)

    with torch.no_grad():
        ours, theirs = turn_logprobs(model, turns, args.batch), per_turn_logprobs(model, turns, args.batch)
    gap = max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True))

    def step(score):
        def run() -> None:
            model.zero_grad(set_to_none=True)
            torch.cat(score(model, turns, args.batch)).sum().backward()

        return run

    k2lab_s, per_turn_s = alternating_medians([step(turn_logprobs), step(per_turn_logprobs)], args.repeats)
    print(
        json.dumps(
            {
                "turns": len(turns),
                "completion_tokens": sum(len(t.completion_ids) for t in turns),
                "max_abs_logprob_gap": gap,
                "k2lab_s": round(k2lab_s, 3),
                "per_turn_s": round(per_turn_s, 3),
                "ratio": round(per_turn_s / k2lab_s, 2),
                "threads": torch.get_num_threads(),
                "machine": run_machine_report(args),
            }
        )
    )


if __name__ == "__main__":
    main()
