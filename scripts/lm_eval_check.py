"""lm-evaluation-harness against ``k2lab serve``: a small local multiple-choice task, checked against k2lab.

Run with k2lab's venv after ``scripts/lm_eval_venv.sh`` (lm-eval lives in a venv of its own)::

    .venv/bin/python scripts/lm_eval_check.py --checkpoint /tmp/spec/demo

1. writes a task (``next_line.yaml`` + ``next_line.jsonl``) of ``--items`` questions made from the running
   interpreter's standard library (what the demo model was trained on): the 6 lines before a line of
   code as context, that line and 3 other lines of the same file and of about its length (0.8–1.25×) as
   the choices (seeded);
2. starts ``k2lab serve`` on the checkpoint and runs ``lm-eval run --model local-completions`` on the task
   (``tokenizer_backend=remote``: lm-eval tokenises through the server's ``/tokenize``; each choice is scored
   with ``echo``, ``logprobs=1``, ``max_tokens=1`` and token-id prompts, batched by ``--batch-size``);
3. recomputes every choice's log-likelihood with a direct k2lab forward — lm-eval's ``_encode_pair`` split
   (trailing whitespace of the context moves to the continuation; the continuation's ids are those of
   ``encode(context + continuation)`` past ``len(encode(context))``), then
   ll = Σ_{i ≥ ctxlen} log p(t_i | t_<i) — and compares it with lm-eval's per-item numbers, and the
   accuracy with the argmax of the direct ones.

``--vllm [VENV]`` serves a ``k2lab export`` of the checkpoint with vLLM's OpenAI server from the vLLM venv
(``scripts/vllm_venv.sh``; the command and CPU workarounds of ``scripts/vllm_check.py``) instead of
``k2lab serve``; the same direct k2lab numbers are the reference.

Writes ``summary.json`` in ``--out`` and exits 1 when a log-likelihood differs by more than ``--tol``
or the accuracies differ. Not part of ``make test`` (it needs the lm-eval venv and minutes of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch
import vllm_check  # scripts/vllm_check.py, beside this script: vLLM's server command (stdlib imports only)

from k2lab.data import load_tokenizer
from k2lab.model_dir import load_model

ROOT = Path(__file__).resolve().parents[1]
TASK = "k2lab_next_line"
MODULES = [
    "textwrap.py",
    "bisect.py",
    "heapq.py",
    "fnmatch.py",
    "shlex.py",
    "glob.py",
    "string.py",
    "colorsys.py",
]
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def code_lines(name: str) -> list[str]:
    return (
        (Path(sysconfig.get_paths()["stdlib"]) / name).read_text(encoding="utf-8").splitlines(keepends=True)
    )


def make_items(count: int, seed: int = 0) -> list[dict]:
    """``count`` next-line questions: {context, choices (4), label}, the right line at a seeded position."""
    rng = random.Random(seed)
    items = []
    while len(items) < count:
        lines = code_lines(MODULES[len(items) % len(MODULES)])
        usable = [i for i in range(6, len(lines)) if 20 <= len(lines[i].strip()) <= 70
                  and not lines[i].lstrip().startswith("#")]  # fmt: skip
        i = rng.choice(usable)
        size = len(lines[i])
        texts = {lines[j].strip(): j for j in usable if lines[j].strip() != lines[i].strip()}
        others = sorted(texts.values())  # one line per distinct text
        alike = [j for j in others if 0.8 <= len(lines[j]) / size <= 1.25]  # length alone gives nothing away
        wrong = rng.sample(alike if len(alike) >= 3 else others, 3)
        choices = [lines[j] for j in wrong]
        label = rng.randrange(4)
        choices.insert(label, lines[i])
        items.append({"context": "".join(lines[i - 6 : i]), "choices": choices, "label": label})
    return items


def write_task(out: Path, count: int) -> Path:
    folder = out / "task"
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "next_line.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in make_items(count)), encoding="utf-8")
    (folder / "next_line.yaml").write_text(TASK_YAML.format(task=TASK, data=data), encoding="utf-8")
    return folder


def start_server(checkpoint: Path, port: int, log: Path, vllm: Path | None = None) -> subprocess.Popen:
    """``k2lab serve`` on ``checkpoint``, or (``vllm``: the vLLM venv) vLLM's OpenAI server on a ``k2lab export``
    of it (``scripts/vllm_check.py``'s command: fp32, its CPU workarounds, ``/tokenizer_info``)."""
    if vllm is None:
        command = [str(ROOT / ".venv/bin/k2lab"), "serve", "-c", str(checkpoint), "--port", str(port),
                   "--model-name", "k2lab-demo"]  # fmt: skip
        server, timeout = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT), 180
    else:
        export = log.parent / "export"
        subprocess.run(
            [str(ROOT / ".venv/bin/k2lab"), "export", str(checkpoint), "--out", str(export)], check=True
        )
        server = vllm_check.start_vllm(str(export), port, "k2lab-demo", log, python=str(vllm / "bin/python"))
        timeout = 900
    vllm_check.wait_healthy(server, port, log, timeout)
    return server


def run_lm_eval(venv: Path, task_dir: Path, out: Path, port: int, batch_size: int) -> float:
    """Seconds lm-eval took; its results and samples land under ``out / "results"``."""
    model_args = (f"model=k2lab-demo,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=remote,"
                  "tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
    command = [str(venv / "bin/lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", TASK, "--include_path", str(task_dir), "--output_path", str(out / "results"),
               "--log_samples", "--batch_size", str(batch_size)]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    shutil.rmtree(out / "results", ignore_errors=True)
    start = time.perf_counter()
    with (out / "lm_eval.log").open("w") as log:
        subprocess.run(command, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's ``_encode_pair``: (context + continuation ids, context length)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tokenizer.encode(context + continuation)
    return whole, len(tokenizer.encode(context))


def direct_loglikelihood(model, ids: list[int], ctxlen: int) -> float:
    """Σ_{i ≥ ctxlen} log p(t_i | t_<i): one forward over ``ids`` [T], logits [T, V]."""
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    targets = torch.tensor(ids[ctxlen:])
    return float(logp[ctxlen - 1 : -1].gather(-1, targets[:, None]).double().sum())  # lm-eval sums in float64


def compare(checkpoint: Path, out: Path) -> dict:
    (samples_path,) = (out / "results").rglob(f"samples_{TASK}_*.jsonl")
    (results_path,) = (out / "results").rglob("results_*.json")
    results = json.loads(results_path.read_text())["results"][TASK]
    model, tokenizer = load_model(checkpoint).eval(), load_tokenizer(checkpoint / "tokenizer.json")
    diffs, correct = [], 0
    for line in samples_path.read_text().splitlines():
        sample = json.loads(line)
        served = [float(r[0]) for r in sample["filtered_resps"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        direct = [direct_loglikelihood(model, *encode_pair(tokenizer, c, x)) for c, x in pairs]
        diffs += [abs(a - b) for a, b in zip(served, direct, strict=True)]
        correct += int(max(range(len(direct)), key=direct.__getitem__) == sample["doc"]["label"])
    count = len(samples_path.read_text().splitlines())
    return {
        "items": count,
        "choices_scored": len(diffs),
        "max_abs_loglikelihood_diff": max(diffs),
        "lm_eval_acc": results["acc,none"],
        "lm_eval_acc_norm": results["acc_norm,none"],
        "direct_acc": correct / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/tmp/spec/demo"))
    parser.add_argument("--venv", type=Path,
                        default=Path(os.environ.get("LM_EVAL_VENV", Path.home() / ".cache/k2lab/lm-eval-venv")))  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "runs/lm-eval")
    parser.add_argument("--items", type=int, default=20)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--vllm", type=Path, nargs="?", const=Path.home() / ".cache/k2lab/vllm-venv", default=None,
                        help="serve a k2lab export with vLLM from this venv (scripts/vllm_venv.sh) instead")  # fmt: skip
    args = parser.parse_args()
    if not (args.venv / "bin/lm_eval").exists():
        raise SystemExit(f"no lm_eval in {args.venv}: run scripts/lm_eval_venv.sh first")
    args.out.mkdir(parents=True, exist_ok=True)
    task_dir = write_task(args.out, args.items)
    server = start_server(args.checkpoint, args.port, args.out / "serve.log", args.vllm)
    try:
        seconds = run_lm_eval(args.venv, task_dir, args.out, args.port, args.batch_size)
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = {**compare(args.checkpoint, args.out), "lm_eval_seconds": round(seconds, 1),
               "load_average": os.getloadavg()[0]}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    ok = summary["max_abs_loglikelihood_diff"] <= args.tol and summary["lm_eval_acc"] == summary["direct_acc"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
