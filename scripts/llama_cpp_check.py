"""llama.cpp (``llama-cpp-python``) runs k2lab's GGUF export like k2lab: tokenisation, greedy tokens, speed.

Run with the llama.cpp venv's python after ``scripts/llama_cpp_venv.sh``::

    ~/.cache/k2lab/llama-venv/bin/python scripts/llama_cpp_check.py --model /tmp/spec/demo \\
        --gguf /tmp/g_demo.gguf --out /tmp/g/llama_check

k2lab's side runs in k2lab's venv (``--k2lab-python``, default ``.venv/bin/python``) as subprocesses of this
same file (``reference`` and ``bench`` modes), which write JSON:

1. ``k2lab export --format gguf`` of ``--model`` to ``--gguf`` unless the file exists;
2. reference: the token ids of ``--prompts`` prompts (code in the style of the demo's training data, prose,
   a chat turn with special tokens), k2lab's greedy continuation of ``--new-tokens`` tokens (``generate``, fp32,
   eager), and on prompt + continuation one full forward with a hook on every router recording, at every
   position and MoE layer, the routing margin m = c_(k) − c_(k+1) of the sorted selection scores
   c = sigmoid(W_r x) + b (within the kept groups): the gap between the last selected and the first
   unselected expert; and the gap between the two largest logits;
3. llama.cpp: ``tokenize(special=True, add_bos=False)`` equal to k2lab's ids; greedy (argmax of each step's
   logits, ``n_threads`` threads) equal to k2lab's, and at the first divergence of a prompt: the step, both
   tokens, the smallest routing margin over the MoE layers at the diverging position (the last of the
   common prefix), the smallest over the whole prefix, and k2lab's top-2 logit gap there;
4. speed: greedy generation of ``--bench-tokens`` tokens from a ``--bench-prompt``-token prompt, prefill
   included, tokens/s = new tokens / wall time, medians of ``--repeats``: llama.cpp at batch 1 and batch 4
   (4 sequences in one ``llama_batch``, through llama-cpp-python's low-level context) beside k2lab's
   ``generate`` eager and compiled (``compile="on"``) at batch 1 and 4, the same threads; ``uptime``'s load
   average is recorded before and after each side.

Each prompt also reports max |Δ| between llama.cpp's and k2lab's logits at the last prompt position
(``first_logits_max_abs_diff``); ``--kv-cache f32`` runs llama.cpp with an fp32 KV cache instead of its default
fp16 one (which alone moves logits by ~1e-4 relative).

A Kimi Linear (KDA + NoPE MLA, llama.cpp's ``kimi-linear`` graph) check needs a model: the ``tiny-kimi-linear``
mode (k2lab's venv) writes a random one to ``--model``: k3-nano in Kimi Linear style (softplus forget gate,
low-rank output gate, plain MLA without a q LoRA as in Kimi-Linear-48B, SwiGLU MoE; layers KDA, MLA, KDA,
MLA) with the vocabulary of
``--tokenizer``, every matrix re-drawn from N(0, 0.15²) (seed 0)::

    .venv/bin/python scripts/llama_cpp_check.py tiny-kimi-linear --model /tmp/kl_tiny
    ~/.cache/k2lab/llama-venv/bin/python scripts/llama_cpp_check.py --model /tmp/kl_tiny --gguf /tmp/kl.gguf \
        --out /tmp/kl_check --bench-tokens 0

Writes ``summary.json`` in ``--out``; exits 1 when tokenisation differs or a prompt diverges where no routing
near-tie (margin < ``--tie``) or logit near-tie decides. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    for key, value in sorted(mapping.items()):\n        if ",
    "def read_config(path):\n    with open(path) as f:\n        ",
    "try:\n    import json\nexcept ImportError:\n    ",
    '"""Utilities for parsing command line arguments."""\n\n',
    "    def __repr__(self):\n        return ",
    "if __name__ == '__main__':\n    ",
    '    raise ValueError("invalid literal for int() with base %d: %r" % (',
    "def _check_arg_types(funcname, *args):\n    hasstr = hasbytes = False\n    for s in args:\n",
    "# Copyright 2001 by the Python Software Foundation. All rights reserved.\n",
    "The quick brown fox jumps over the lazy dog. ",
    "    return [x * 2 for x in range(10) if x % 3 == ",
    "<|im_user|>user<|im_middle|>Write a function that adds two numbers.<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>",
    "    @property\n    def name(self):\n        ",
]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ---- k2lab's side (k2lab's venv) --------------------------------------------------------------------------
def routing_hooks(model, margins: list):
    """Forward hooks on every router appending m = c_(k) − c_(k+1) per position ([T] tensors, layer order)."""
    from k2lab.nn.router import SigmoidRouter

    def hook(router, inputs, routing):
        choice = routing.scores.detach() + router.e_score_correction_bias
        if router.n_group > 1:
            choice = router._mask_unselected_groups(choice)
        ranked = choice.sort(dim=-1, descending=True).values
        margins.append(ranked[:, router.top_k - 1] - ranked[:, router.top_k])

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, SigmoidRouter)]


def reference(args: argparse.Namespace) -> dict:
    import torch

    from k2lab.data import load_tokenizer
    from k2lab.infer import GenerationConfig, generate
    from k2lab.model_dir import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    tokenizer = load_tokenizer(Path(args.model) / "tokenizer.json")
    rows = []
    for text in PROMPTS[: args.prompts]:
        ids = tokenizer.encode(text)
        config = GenerationConfig(max_new_tokens=args.new_tokens, compile="off")
        greedy = generate(model, [ids], config)[0]
        margins: list = []
        hooks = routing_hooks(model, margins)
        with torch.no_grad():
            logits = model(torch.tensor([ids + greedy[:-1]])).logits[0].float()
        for hook in hooks:
            hook.remove()
        top2 = logits.topk(2, dim=-1).values
        first_logits = logits[len(ids) - 1].tolist()
        per_position = torch.stack(margins).min(dim=0).values  # [T]: the smallest over MoE layers
        rows.append(
            {
                "text": text,
                "ids": ids,
                "greedy": greedy,
                "forward_greedy": logits.argmax(dim=-1)[len(ids) - 1 :].tolist(),
                "margins": per_position.tolist(),
                "logit_gaps": (top2[:, 0] - top2[:, 1]).tolist(),
                "first_logits": first_logits,
            }
        )
    return {"prompts": rows}


def tiny_kimi_linear(args: argparse.Namespace) -> dict:
    """The random Kimi-Linear-style model directory of the module docstring, at ``--model``."""
    import shutil

    import torch

    from k2lab import build_model, load_preset
    from k2lab.data import load_tokenizer
    from k2lab.model_dir import save_model

    tokenizer = load_tokenizer(args.tokenizer)
    style = dict(kda_gate="softplus", kda_output_gate="low_rank", mla_output_gate=False)
    style.update(mlp_activation="swiglu", moe_latent_size=None, attnres_block_size=None, q_lora_rank=None)
    config = load_preset("k3-nano", **style).replace(
        vocab_size=tokenizer.vocab_size,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    model = build_model(config, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(0.15 * torch.randn(parameter.shape, generator=generator))
    directory = save_model(model.eval(), args.model)
    shutil.copy(args.tokenizer, directory / "tokenizer.json")
    return {"model": str(directory), "layer_types": list(config.layer_types)}


def bench_k2lab(args: argparse.Namespace) -> dict:
    import torch

    from k2lab.infer import GenerationConfig, generate
    from k2lab.model_dir import load_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timing import alternating_medians

    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    generator = torch.Generator().manual_seed(0)
    result: dict = {"load_before": load_average()}
    for batch in (1, 4):
        prompts = torch.randint(20, 8000, (batch, args.bench_prompt), generator=generator).tolist()
        runs = []
        for mode in ("off", "on"):
            config = GenerationConfig(max_new_tokens=args.bench_tokens, compile=mode)
            runs.append(lambda config=config, prompts=prompts: generate(model, prompts, config))
        eager, compiled = alternating_medians(runs, args.repeats, warmup=1)
        result[f"b{batch}"] = {
            "eager_tokens_per_s": batch * args.bench_tokens / eager,
            "compiled_tokens_per_s": batch * args.bench_tokens / compiled,
        }
    result["load_after"] = load_average()
    return result


# ---- llama.cpp's side (the llama.cpp venv) ----------------------------------------------------------------
def last_logits(llm, index: int = -1):
    import numpy as np

    pointer = llm._ctx.get_logits_ith(index)
    return np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),))


def llama_greedy(llm, ids: list[int], steps: int, first: list | None = None) -> list[int]:
    """Greedy continuation of ``ids``; appends the logits after the prompt to ``first`` when given."""
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(ids)
    out: list[int] = []
    for _ in range(steps):
        logits = last_logits(llm)
        if first is not None and not out:
            first.append(logits.copy())
        token = int(logits.argmax())
        out.append(token)
        if len(out) < steps:
            llm.eval([token])
    return out


def divergence(row: dict, theirs: list[int], tie: float) -> dict | None:
    ours = row["greedy"]
    step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if step is None:
        return None
    position = len(row["ids"]) - 1 + step  # the last position of the common prefix
    margin = row["margins"][position]
    gap = row["logit_gaps"][position]
    return {
        "step": step,
        "k2lab": ours[step],
        "llama_cpp": theirs[step],
        "routing_margin": margin,
        "min_routing_margin_prefix": min(row["margins"][: position + 1]),
        "k2lab_logit_gap": gap,
        "near_tie": margin < tie or gap < tie,  # the prefix's smallest margin is reported, not excused
    }


def llama_batched(llm, prompts: list[list[int]], steps: int) -> float:
    """Seconds to prefill ``prompts`` as sequences 0..B-1 of one batch and decode ``steps`` tokens each."""
    from llama_cpp import _internals

    params = llm.context_params
    params.n_seq_max = len(prompts)
    context = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
    batch = _internals.LlamaBatch(n_tokens=llm.n_batch, embd=0, n_seq_max=len(prompts), verbose=False)
    try:
        start = time.perf_counter()
        batch.reset()
        for seq, ids in enumerate(prompts):
            batch.add_sequence(ids, seq, False)
        context.decode(batch)
        ends = [sum(len(p) for p in prompts[: seq + 1]) - 1 for seq in range(len(prompts))]
        positions = [len(p) for p in prompts]
        for _ in range(steps):
            tokens = [int(last_np(context, llm.n_vocab(), i).argmax()) for i in ends]
            raw = batch.batch
            raw.n_tokens = len(prompts)
            for seq, token in enumerate(tokens):
                raw.token[seq], raw.pos[seq] = token, positions[seq]
                raw.seq_id[seq][0], raw.n_seq_id[seq], raw.logits[seq] = seq, 1, True
                positions[seq] += 1
            context.decode(batch)
            ends = list(range(len(prompts)))
        return time.perf_counter() - start
    finally:
        batch.close()
        context.close()


def last_np(context, n_vocab: int, index: int):
    import numpy as np

    return np.ctypeslib.as_array(context.get_logits_ith(index), shape=(n_vocab,))


def bench_llama(llm, args: argparse.Namespace) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    result: dict = {"load_before": load_average()}
    prompt = rng.integers(20, 8000, args.bench_prompt).tolist()
    llama_greedy(llm, prompt, 4)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        llama_greedy(llm, prompt, args.bench_tokens)
        times.append(time.perf_counter() - start)
    result["b1"] = {"tokens_per_s": args.bench_tokens / statistics.median(times)}
    prompts = rng.integers(20, 8000, (4, args.bench_prompt)).tolist()
    try:
        llama_batched(llm, prompts, 4)
        batched = [llama_batched(llm, prompts, args.bench_tokens) for _ in range(args.repeats)]
        result["b4"] = {"tokens_per_s": 4 * args.bench_tokens / statistics.median(batched)}
    except Exception as error:  # noqa: BLE001 - report why batch 4 could not run, keep batch 1
        result["b4"] = {"error": f"{type(error).__name__}: {error}"}
    result["load_after"] = load_average()
    return result


def k2lab_json(args: argparse.Namespace, mode: str, out: Path) -> dict:
    if args.reuse and out.exists():
        return json.loads(out.read_text())
    command = [args.k2lab_python, __file__, mode, "--model", args.model, "--json", str(out)]
    command += ["--threads", str(args.threads), "--prompts", str(args.prompts)]
    command += ["--new-tokens", str(args.new_tokens), "--bench-tokens", str(args.bench_tokens)]
    command += ["--bench-prompt", str(args.bench_prompt), "--repeats", str(args.repeats)]
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.read_text())


def check(args: argparse.Namespace) -> int:
    from llama_cpp import Llama, __version__

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = Path(args.gguf)
    if not gguf.exists():
        k2lab = str(Path(args.k2lab_python).parent / "k2lab")
        subprocess.run([k2lab, "export", args.model, "--format", "gguf", "-o", str(gguf)], check=True)
    ref = k2lab_json(args, "reference", out / "reference.json")
    cache = {"type_k": 0, "type_v": 0} if args.kv_cache == "f32" else {}  # 0 = GGML_TYPE_F32
    llm = Llama(
        str(gguf),
        n_ctx=512,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
        **cache,
    )
    rows, failures = [], 0
    for row in ref["prompts"]:
        ids = llm.tokenize(row["text"].encode(), add_bos=False, special=True)
        first: list = []
        theirs = llama_greedy(llm, row["ids"], len(row["greedy"]), first)
        logit_diff = max(abs(float(a) - b) for a, b in zip(first[0], row["first_logits"], strict=True))
        diverged = divergence(row, theirs, args.tie)
        same_ids = ids == row["ids"]
        failures += (not same_ids) + (diverged is not None and not diverged["near_tie"])
        rows.append(
            {
                "text": row["text"],
                "same_ids": same_ids,
                "k2lab": row["greedy"],
                "llama_cpp": theirs,
                "forward_equals_generate": row["forward_greedy"] == row["greedy"],
                "first_logits_max_abs_diff": logit_diff,
                "divergence": diverged,
            }
        )
        print(
            f"{'=' if diverged is None else '≠'} ids {'ok' if same_ids else 'DIFFER'} |Δlogit| {logit_diff:.2e}"
            f" {row['text'][:40]!r}" + ("" if diverged is None else f"  {diverged}")
        )
    summary = {
        "llama_cpp_python": __version__,
        "gguf": str(gguf),
        "threads": args.threads,
        "kv_cache": args.kv_cache,
        "same_ids": sum(r["same_ids"] for r in rows),
        "same_greedy": sum(r["divergence"] is None for r in rows),
        "prompts": len(rows),
        "max_first_logits_abs_diff": max(r["first_logits_max_abs_diff"] for r in rows),
        "rows": rows,
    }
    if args.bench_tokens:
        summary["k2lab_bench"] = k2lab_json(args, "bench", out / "bench.json")
        summary["llama_cpp_bench"] = bench_llama(llm, args)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=2))
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "mode", nargs="?", default="check", choices=["check", "reference", "bench", "tiny-kimi-linear"]
    )
    parser.add_argument("--model", default="/tmp/spec/demo")
    parser.add_argument("--gguf", default="/tmp/g_demo.gguf")
    parser.add_argument("--tokenizer", default="/tmp/spec/demo/tokenizer.json", help="(tiny-kimi-linear)")
    parser.add_argument("--out", default="/tmp/llama_cpp_check")
    parser.add_argument("--json", help="(reference / bench modes) where to write the result")
    parser.add_argument("--k2lab-python", default=str(ROOT / ".venv" / "bin" / "python"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--bench-tokens", type=int, default=64, help="0 skips the speed rows")
    parser.add_argument("--bench-prompt", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache", choices=["f16", "f32"], default="f16", help="llama.cpp's KV cache type")
    parser.add_argument("--reuse", action="store_true", help="reuse reference.json / bench.json in --out")
    parser.add_argument("--tie", type=float, default=1e-3, help="a margin below this is a near-tie")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "check":
        return check(args)
    if args.mode == "tiny-kimi-linear":
        print(json.dumps(tiny_kimi_linear(args)))
        return 0
    result = reference(args) if args.mode == "reference" else bench_k2lab(args)
    Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
