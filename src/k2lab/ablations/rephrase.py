"""Rephrasing ablation: K2's "10 rephrasings × 1 epoch vs raw text × 10 epochs" at small scale.

A raw subset (``docs`` training documents of ``--data`` or the embedded corpus, each cut to ``doc_chars``
at a boundary) is trained on twice with the same recipe, seed, tokenizer, token budget and held-out set:

* **raw**: the raw subset, repeated — the step count is chosen so the run sees ``K = n_rephrasings``
  epochs of it;
* **rephrased**: ``K`` versions of every document, each seen once — version ``k`` is the document's
  ``k``-th kept rephrasing (``k2lab.data.rephrase``: chunk-wise autoregressive, style-diverse,
  fidelity-checked) or, where the fidelity check dropped it or the endpoint failed, the raw text itself
  (a verified-rephrasing pipeline keeps the source where the rewrite is unfaithful).

Rephrasings come from an OpenAI-compatible endpoint (``base_url``), or from k2lab's own server started in
this process over ``checkpoint``, or are reused from an existing rephrased corpus (``rephrased``). They
are cached in ``OUT/rephrased`` (resumable). Both arms train with one tokenizer (BPE on the raw subset,
``OUT/tokenizer.json``); each arm's data directory holds ``train.jsonl`` and the same raw held-out file, which
``load_corpus`` puts in validation, so the trainer's validation loss is the loss on raw held-out text.

Measured per arm: the final validation loss on raw held-out documents, and a cloze **QA probe** on
facts of the raw training documents ("Question: <sentence with a number or name blanked> Answer: <it>"):
the mean loss of the answer tokens and the share of answers whose every token is the argmax
(teacher-forced). Outputs: ``OUT/rephrase.{md,json,png}``; runs in ``OUT/runs/{raw,rephrased}``, reused when
the command is repeated with the same data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from rich.console import Console

from k2lab.ablations.common import (
    AblationSettings,
    PlannedRun,
    StudyRun,
    drop_weights,
    recipe_settings,
    run_times,
    tokens_per_step,
    val_points,
    with_updates,
)
from k2lab.ablations.report import (
    Report,
    finish_axes,
    fmt,
    md_table,
    new_figure,
    plot_val_curve,
    rich_table,
    timing_note,
    write_json,
)
from k2lab.data import load_tokenizer
from k2lab.data.corpus import Document, load_corpus, stable_rank
from k2lab.data.rephrase import (
    DEFAULT_STYLES,
    NUMBER,
    SENTENCE_END,
    STOPWORDS,
    RephraseSettings,
    kept_rephrasings,
    rephrase_corpus,
    split_chunks,
)
from k2lab.data.tokenizer import train_tokenizer
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text, holds, save_figure_atomically
from k2lab.model_dir import load_model
from k2lab.serve import Engine
from k2lab.serve.threads import hand_threads_to_engine
from k2lab.train.config import TrainConfig
from k2lab.train.metrics import read_metrics
from k2lab.train.pretraining import tokenizer_family_for

ARMS = ("raw", "rephrased")
COLORS = {"raw": "tab:gray", "rephrased": "tab:red"}
PROBE_FILE = "probe.json"

# k2-mini on 32 documents × 1000 characters of the embedded corpus, 4 rephrasings (the K2 recipe used 10):
# 2 runs of ~100 steps × 4×128 tokens side by side (~2 min on 2 CPU cores), after the rephrasing itself
# (~5 min through k2lab's server over a k2-mini checkpoint on 2 CPU cores; it depends on the endpoint).
DEFAULT_RECIPE: dict[str, Any] = {
    "preset": "k2-mini",
    "vocab_size": 512,
    "steps": 100,  # replaced by the token budget unless given
    "batch_size": 4,
    "seq_len": 128,
    "eval_batches": 8,
    "sample_tokens": 0,
    "precision": "fp32",
    "schedule": {"kind": "wsd", "warmup_steps": 10, "decay_fraction": 0.2, "min_lr_ratio": 0.1},
}


class RephraseAblationConfig(AblationSettings):
    """The ablation: the raw subset, the rephrasing source and settings, the base recipe (everything but
    the data, which each arm brings)."""

    TEXT_ONLY = True
    BASE = DEFAULT_RECIPE
    EVAL_POINTS = 5
    WHAT = "rephrasing ablation setting"

    data: str | None = Field(
        default=None, description="Directory of .txt/.md/.jsonl (unset: embedded corpus)"
    )
    docs: int = Field(default=32, gt=0, description="Raw training documents in the subset")
    doc_chars: int = Field(default=1000, gt=0, description="Characters kept per document")
    heldout_docs: int = Field(default=8, gt=0, description="Raw held-out documents for validation")
    n_rephrasings: int = Field(default=4, gt=0, description="K: rephrasings per document = raw epochs")
    steps: int | None = Field(
        default=None, gt=0, description="Steps per arm (unset: K epochs of the raw subset's tokens)"
    )
    rephrased: str | None = Field(
        default=None, description="Reuse this `k2lab data rephrase` output instead of rephrasing"
    )
    base_url: str | None = Field(
        default=None, description="OpenAI-compatible endpoint for the rephrasings, e.g. http://host/v1"
    )
    model: str | None = Field(default=None, description="Model name at --base-url")
    api_key: str | None = Field(default=None, description="API key of --base-url ($OPENAI_API_KEY)")
    checkpoint: str | None = Field(
        default=None, description="Serve this checkpoint in-process for the rephrasings (no --base-url)"
    )
    chunk_chars: int = Field(default=400, gt=0, description="Characters per rephrased chunk")
    tail_chars: int = Field(default=300, ge=0, description="Characters of the rephrasing so far in a prompt")
    styles: list[str] = Field(default_factory=lambda: list(DEFAULT_STYLES), description="Rephrasing styles")
    fidelity_threshold: float = Field(
        default=0.5, ge=0, le=1, description="Drop rephrasings scoring below this (0-1)"
    )
    concurrency: int = Field(default=8, gt=0, description="Requests in flight")
    max_tokens: int | None = Field(
        default=None, gt=0, description="Completion tokens per chunk (unset: about half its characters)"
    )
    probe_items: int = Field(default=64, ge=0, description="QA probe questions (0 skips the probe)")
    jobs: int = Field(default=len(ARMS), gt=0, description="Arms trained at once, in worker processes")
    out: str = Field(default="runs/rephrase", description="Output directory")


# ---- data ------------------------------------------------------------------------------------------------
def _cut_doc(document: Document, chars: int) -> Document:
    return Document(document.path, split_chunks(document.text, chars)[0])


def select_raw(ablation: RephraseAblationConfig) -> tuple[list[Document], list[Document]]:
    """The raw training subset and held-out documents: a deterministic sample, each cut to ``doc_chars``."""
    corpus = load_corpus(ablation.data)
    if not corpus.val:
        raise K2LabError(f"corpus {corpus.name} has no held-out documents (it needs at least two files)")

    def pick(docs: list[Document], count: int) -> list[Document]:
        ranked = sorted((d for d in docs if d.text.strip()), key=lambda d: stable_rank(d.path, "sample"))
        return [_cut_doc(d, ablation.doc_chars) for d in ranked[:count]]

    return pick(corpus.train, ablation.docs), pick(corpus.val, ablation.heldout_docs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(checkpoint: str | Path, max_batch: int = 16) -> Iterator[tuple[str, str]]:
    """k2lab's OpenAI-compatible server over ``checkpoint`` on loopback in this process: (base_url, model).

    While it runs, the calling thread is single-threaded and the engine's thread has torch's threads, as in
    ``k2lab serve`` (``k2lab.serve.threads``: one OpenMP team; with two, the engine's small ops each paid a
    kernel wake). Its thread count comes back on exit, for the training that follows."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "tokenizer.json").is_file():
        raise K2LabError(f"{checkpoint} has no tokenizer.json: the server needs one to render chats")
    threads = hand_threads_to_engine()
    engine = None
    try:
        model = load_model(checkpoint)
        engine = Engine(getattr(model, "language_model", model), max_batch=max_batch, threads=threads).start()
        with _serving(engine, checkpoint) as (base_url, name):
            yield base_url, name
    finally:
        if engine is not None:
            engine.shutdown()
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _serving(engine: Engine, checkpoint: Path) -> Iterator[tuple[str, str]]:
    """uvicorn over ``engine`` in a daemon thread on a free loopback port: (base_url, model name)."""
    import uvicorn  # lazy: uvicorn (0.2 s) only for the local server

    from k2lab.serve.server import build_app  # lazy: the server imports fastapi (0.3 s)

    name = checkpoint.resolve().name
    port = free_port()
    app = build_app(engine, load_tokenizer(checkpoint / "tokenizer.json"), name)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    try:
        if not server.started:
            raise K2LabError(f"k2lab's server over {checkpoint} did not start")
        yield f"http://127.0.0.1:{port}/v1", name
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def rephrase_settings(ablation: RephraseAblationConfig, base_url: str, model: str) -> RephraseSettings:
    return RephraseSettings(
        base_url=base_url, model=model, api_key=ablation.api_key, n_rephrasings=ablation.n_rephrasings,
        chunk_chars=ablation.chunk_chars, tail_chars=ablation.tail_chars, styles=tuple(ablation.styles),
        fidelity_threshold=ablation.fidelity_threshold, concurrency=ablation.concurrency,
        max_tokens=ablation.max_tokens, seed=ablation.base.seed,
    )  # fmt: skip


def produce_rephrasings(ablation: RephraseAblationConfig, docs: list[Document], console: Console) -> Path:
    """The rephrased corpus directory: ``rephrased`` as given, else ``OUT/rephrased`` filled (resumably)
    through ``base_url`` or a local server over ``checkpoint``."""
    if ablation.rephrased:
        if not (Path(ablation.rephrased) / "manifest.json").is_file():
            raise K2LabError(
                f"{ablation.rephrased} has no manifest.json (not a `k2lab data rephrase` output)"
            )
        return Path(ablation.rephrased)
    target = Path(ablation.out) / "rephrased"
    if ablation.base_url:
        server = contextlib.nullcontext((ablation.base_url, ablation.model or "default"))
    elif ablation.checkpoint:
        server = local_server(ablation.checkpoint, max_batch=max(ablation.concurrency, 1))
    else:
        raise K2LabError("give --base-url (an OpenAI-compatible endpoint), --checkpoint or --rephrased")
    with server as (base_url, model):
        console.print(f"rephrasing {len(docs)} documents × {ablation.n_rephrasings} through {base_url}")
        settings = rephrase_settings(ablation, base_url, model)
        report = rephrase_corpus(docs, target, settings)
    console.print(
        f"rephrasing: {report.done} done, {report.skipped} already done, {report.failed} failed; "
        f"{report.kept} kept, {report.dropped} dropped by the fidelity check ({report.seconds:.0f}s)"
    )
    report.check_endpoint()  # else the rephrased arm would be the raw text, and the study compare it to itself
    return target


def arm_versions(
    docs: list[Document], rephrased: Path, k: int, threshold: float | None = None
) -> tuple[list[Document], dict[str, Any]]:
    """The rephrased arm's documents: ``k`` versions per raw document (kept rephrasings, then raw text);
    ``threshold`` re-decides the fidelity verdicts from the recorded scores."""
    kept = kept_rephrasings(rephrased, threshold)
    manifest = json.loads((rephrased / "manifest.json").read_text())["documents"]
    versions, used, scores = [], 0, []
    for document in docs:
        texts = [text for _, text in kept.get(document.path, [])][:k]
        used += len(texts)
        versions += [Document(f"{document.path}#r{i}", text) for i, text in enumerate(texts)]
        versions += [Document(f"{document.path}#raw{i}", document.text) for i in range(len(texts), k)]
        entry = manifest.get(document.path, {})
        scores += [r["score"] for r in entry.get("rephrasings", [])]
    stats = {
        "rephrased_dir": str(rephrased),
        "slots": k * len(docs),
        "rephrased_slots": used,
        "kept_fraction": used / max(1, k * len(docs)),
        "mean_fidelity": sum(scores) / len(scores) if scores else math.nan,
        "failed_documents": sum(manifest.get(d.path, {}).get("status") == "failed" for d in docs),
        "missing_documents": sum(d.path not in manifest for d in docs),
    }
    return versions, stats


def _jsonl(docs: list[Document]) -> str:
    return "".join(json.dumps({"text": d.text, "source": d.path}) + "\n" for d in docs)


def val_file_name() -> str:
    """A held-out file name that ``load_corpus`` puts in validation next to ``train.jsonl`` (lower rank)."""
    train_rank = stable_rank("train.jsonl", "split")
    return next(
        name
        for name in (f"heldout-{i}.jsonl" for i in range(1000))
        if stable_rank(name, "split") < train_rank
    )


def write_arm(out: Path, arm: str, train: list[Document], heldout: list[Document]) -> Path:
    """``OUT/data/{arm}-{hash}/`` with ``train.jsonl`` and the held-out file (named by content, so a run
    recipe changes exactly when its data does)."""
    train_text, heldout_text = _jsonl(train), _jsonl(heldout)
    digest = hashlib.sha256((train_text + "\0" + heldout_text).encode()).hexdigest()[:12]
    folder = out / "data" / f"{arm}-{digest}"
    if not folder.is_dir():
        atomic_write_text(folder / "train.jsonl", train_text)
        atomic_write_text(folder / val_file_name(), heldout_text)
    return folder


def shared_tokenizer(raw_dir: Path, out: Path, vocab_size: int, family: str = "k2") -> tuple[Path, Any]:
    """A BPE trained on the raw subset with the model ``family``'s special tokens, saved to
    ``OUT/tokenizer.json`` (both arms use it)."""
    tokenizer = train_tokenizer(load_corpus(raw_dir), vocab_size, family=family)
    path = out / "tokenizer.json"
    tokenizer.save(path)
    return path, tokenizer


def count_tokens(docs: list[Document], tokenizer) -> int:
    """Tokens of ``docs`` in the packed stream (ids + one EOS per document)."""
    return sum(len(ids) + 1 for ids in tokenizer.encode_batch([d.text for d in docs]))


# ---- the QA probe ----------------------------------------------------------------------------------------
def probe_items(docs: list[Document], limit: int) -> list[tuple[str, str]]:
    """Cloze questions on facts of ``docs``: a sentence with its last number or name blanked, and that answer.

    Round-robin over the documents (first usable sentences first), at most ``limit`` items.
    """
    per_doc = []
    for document in docs:
        items = []
        starts = [0, *(m.end() for m in SENTENCE_END.finditer(document.text))]
        for begin, end in zip(starts, [*starts[1:], len(document.text)], strict=True):
            sentence = " ".join(document.text[begin:end].split())
            answer = _fact(sentence)
            if answer and 20 <= len(sentence) <= 300:
                cut = sentence.rfind(answer)
                question = sentence[:cut] + "___" + sentence[cut + len(answer) :]
                items.append((f"Question: fill in the blank. {question}\nAnswer:", f" {answer}"))
        per_doc.append(items)
    merged = [item for group in _round_robin(per_doc) for item in group]
    return merged[:limit]


def _round_robin(groups: list[list[tuple[str, str]]]) -> Iterator[list[tuple[str, str]]]:
    for index in range(max((len(g) for g in groups), default=0)):
        yield [g[index] for g in groups if index < len(g)]


def _fact(sentence: str) -> str | None:
    """The sentence's last number, else its last capitalised non-initial word (not a stopword)."""
    numbers = NUMBER.findall(sentence)
    if numbers:
        return numbers[-1]
    words = sentence.split()[1:]
    names = [w.strip(".,;:!?()\"'") for w in words if w[:1].isupper() and w.lower() not in STOPWORDS]
    names = [n for n in names if len(n) >= 3]
    return names[-1] if names else None


@torch.no_grad()
def run_probe(model_dir: Path, items: list[tuple[str, str]]) -> dict[str, float]:
    """Mean answer-token loss and exact-argmax accuracy of the model in ``model_dir`` on ``items``."""
    if not items:
        return {"probe_loss": math.nan, "probe_accuracy": math.nan, "probe_items": 0}
    model = load_model(model_dir).eval()
    model = getattr(model, "language_model", model)
    tokenizer = load_tokenizer(model_dir / "tokenizer.json")
    limit = model.config.max_position_embeddings
    losses, correct = [], 0
    for question, answer in items:
        answer_ids = tokenizer.encode(answer)
        ids = ([tokenizer.bos_id] + tokenizer.encode(question) + answer_ids)[-limit:]
        logits = model(torch.tensor([ids[:-1]])).logits[0, -len(answer_ids) :].float()
        target = torch.tensor(answer_ids)
        losses.append(float(torch.nn.functional.cross_entropy(logits, target)))
        correct += bool((logits.argmax(-1) == target).all())
    return {
        "probe_loss": sum(losses) / len(losses),
        "probe_accuracy": correct / len(items),
        "probe_items": len(items),
    }


def probe_run(config: TrainConfig, items: list[tuple[str, str]], keep_weights: bool) -> dict[str, float]:
    """The probe of a finished run (cached in ``probe.json`` by items); drops its weights unless kept."""
    run_dir = Path(config.out)
    key = hashlib.sha256(json.dumps(items).encode()).hexdigest()
    cache = run_dir / PROBE_FILE
    if cache.is_file():
        cached = json.loads(cache.read_text())
        if cached.get("items_sha256") == key:
            return cached["scores"]
    if not (run_dir / "model").is_dir():
        return {"probe_loss": math.nan, "probe_accuracy": math.nan, "probe_items": 0}
    scores = run_probe(run_dir / "model", items)
    write_json(cache, {"items_sha256": key, "scores": scores})
    if not keep_weights:
        drop_weights(run_dir)
    return scores


# ---- the ablation ----------------------------------------------------------------------------------------
def plan_runs(
    ablation: RephraseAblationConfig, dirs: dict[str, Path], tokenizer_path: Path, raw_tokens: int
) -> list[TrainConfig]:
    """One recipe per arm: same everything but the data directory and the run directory."""
    base = ablation.base
    steps = ablation.steps or max(1, round(ablation.n_rephrasings * raw_tokens / tokens_per_step(base)))
    eval_every = max(1, steps // RephraseAblationConfig.EVAL_POINTS)
    warmup = min(base.schedule.warmup_steps, max(0, steps // 5))
    schedule = base.schedule.model_copy(update={"warmup_steps": warmup})
    return [
        with_updates(
            base,
            data=str(dirs[arm]),
            data_max_bytes=None,
            tokenizer=str(tokenizer_path),
            steps=steps,
            eval_every=eval_every,
            save_every=steps,
            schedule=schedule,
            out=str(Path(ablation.out) / "runs" / arm),
        )  # fmt: skip
        for arm in ARMS
    ]


def run_rephrase_ablation(ablation: RephraseAblationConfig, console: Console | None = None) -> dict[str, Any]:
    """Rephrase (or reuse), train both arms (or reuse), probe, write OUT/rephrase.{json,md,png}."""
    if ablation.data is not None and holds(Path(ablation.data), Path(ablation.out)):
        raise K2LabError(
            f"--out {ablation.out} is inside --data {ablation.data}: a rerun would read the study's own "
            "rephrasings and arm data as raw documents; choose an --out outside it"
        )
    study = StudyRun(ablation, console or Console())
    out = Path(ablation.out)
    raw, heldout = select_raw(ablation)
    rephrase_start = time.perf_counter()
    rephrased_dir = produce_rephrasings(ablation, raw, study.console)
    rephrase_seconds = time.perf_counter() - rephrase_start
    versions, stats = arm_versions(raw, rephrased_dir, ablation.n_rephrasings, ablation.fidelity_threshold)
    stats["seconds"] = rephrase_seconds
    dirs = {
        "raw": write_arm(out, "raw", raw, heldout),
        "rephrased": write_arm(out, "rephrased", versions, heldout),
    }
    vocab = ablation.base.vocab_size or 512
    family = tokenizer_family_for(ablation.base.preset, ablation.base.model_overrides)
    tokenizer_path, tokenizer = shared_tokenizer(dirs["raw"], out, vocab, family)
    tokens = {"raw": count_tokens(raw, tokenizer), "rephrased": count_tokens(versions, tokenizer)}
    configs = plan_runs(ablation, dirs, tokenizer_path, tokens["raw"])
    plan = [
        PlannedRun(c, f"{arm}: {c.steps} steps on {Path(c.data).name} → {c.out}", arm)
        for arm, c in zip(ARMS, configs, strict=True)
    ]
    items = probe_items(raw, ablation.probe_items)

    def describe(index: int, summary: dict) -> str:
        return f"{ARMS[index]}: final val loss {summary.get('val_loss', math.nan):.4f}"

    # the probe needs the weights: the runs keep them, the probe drops them unless keep_weights
    outcomes = study.train(plan, describe, ablation.model_copy(update={"keep_weights": True}))
    runs = [
        summarize_run(
            arm, config, summary, reused, tokens[arm], probe_run(config, items, ablation.keep_weights)
        )
        for arm, config, (summary, reused) in zip(ARMS, configs, outcomes, strict=True)
    ]
    results = analyse(ablation, configs[0], runs, stats, tokens, len(raw), len(heldout))
    return study.finish(results, runs, REPORT)


def summarize_run(
    arm: str, config: TrainConfig, summary: dict, reused: bool, arm_tokens: int, probe: dict[str, float]
) -> dict[str, Any]:
    """One arm's figures from its metrics and probe."""
    records = read_metrics(config.out)
    per_step = tokens_per_step(config)
    val = val_points(records)
    return {
        "arm": arm,
        "run_dir": config.out,
        "data": config.data,
        "steps": len(records),
        "tokens": len(records) * per_step,
        "data_tokens": arm_tokens,
        "epochs": len(records) * per_step / max(1, arm_tokens),
        "first_loss": float(records[0]["loss"]) if records else math.nan,
        "loss": [float(r["loss"]) for r in records],
        "final_val_loss": val[-1][1] if val else math.nan,
        "val_curve": [{"step": s, "val_loss": v} for s, v in val],
        "unigram_baseline": summary.get("unigram_baseline", math.nan),
        **probe,
        **run_times(summary, reused),
    }


def analyse(
    ablation: RephraseAblationConfig,
    config: TrainConfig,
    runs: list[dict[str, Any]],
    stats: dict[str, Any],
    tokens: dict[str, int],
    n_docs: int,
    n_heldout: int,
) -> dict[str, Any]:
    """Settings, rephrasing statistics, the runs, and the fairness checks."""
    settings = {
        **recipe_settings(config),
        "data": ablation.data or "embedded stdlib corpus",
        "docs": n_docs,
        "heldout_docs": n_heldout,
        "doc_chars": ablation.doc_chars,
        "n_rephrasings": ablation.n_rephrasings,
        "styles": ablation.styles,
        "chunk_chars": ablation.chunk_chars,
        "fidelity_threshold": ablation.fidelity_threshold,
        "source": ablation.rephrased or ablation.base_url or f"k2lab server over {ablation.checkpoint}",
        "raw_tokens": tokens["raw"],
        "rephrased_tokens": tokens["rephrased"],
    }
    return {
        "settings": settings,
        "rephrasing": stats,
        "runs": runs,
        "same_tokens": len({run["tokens"] for run in runs}) == 1,
        "same_first_loss": len({run["first_loss"] for run in runs}) == 1,
    }


# ---- outputs ---------------------------------------------------------------------------------------------
def arm_label(results: dict[str, Any], run: dict[str, Any]) -> str:
    k = results["settings"]["n_rephrasings"]
    return f"raw × {k} epochs" if run["arm"] == "raw" else f"{k} rephrasings × 1 epoch"


def table_header() -> list[str]:
    return [
        "arm", "data tokens", "epochs seen", "final val loss (raw held-out)", "QA probe loss",
        "QA probe accuracy", "training min",
    ]  # fmt: skip


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    return [
        [
            arm_label(results, run),
            f"{run['data_tokens']:,}",
            fmt(run["epochs"], ".2f"),
            fmt(run["final_val_loss"], ".4f"),
            fmt(run["probe_loss"], ".3f"),
            fmt(run["probe_accuracy"], ".3f"),
            fmt(run["seconds"] / 60, ".1f"),
        ]  # fmt: skip
        for run in results["runs"]
    ]


def markdown_report(results: dict[str, Any]) -> str:
    """``rephrase.md``: the settings, the rephrasing statistics and the comparison table."""
    s, r = results["settings"], results["rephrasing"]
    fair = "equal" if results["same_first_loss"] else "not equal (different first batches)"
    lines = [
        f"# Rephrasing ablation: {s['preset']}, {s['steps']} steps × {s['tokens_per_step']:,} tokens "
        f"({s['tokens']:,} tokens per arm)",
        "",
        f"Raw subset: {s['docs']} documents of {s['data']} (≤ {s['doc_chars']} characters each, "
        f"{s['raw_tokens']:,} tokens); validation on {s['heldout_docs']} raw held-out documents. "
        f"Same seed ({s['seed']}), tokenizer, lr schedule and token budget for both arms; step-1 losses {fair}.",
        "",
        f"Rephrasings: {s['n_rephrasings']} per document from {s['source']}, styles {', '.join(s['styles'])}, "
        f"chunks of ≤ {s['chunk_chars']} characters; fidelity threshold {s['fidelity_threshold']:g}. "
        f"{r['rephrased_slots']} of {r['slots']} slots hold a kept rephrasing ({100 * r['kept_fraction']:.0f} %; "
        f"the rest repeat the raw text); mean fidelity score {fmt(r['mean_fidelity'])}; "
        f"{r['failed_documents']} documents failed at the endpoint. Rephrased arm: {s['rephrased_tokens']:,} tokens.",
        "",
        *md_table(table_header(), table_rows(results)),
        "",
        "The QA probe is a cloze on facts (numbers, names) of the raw training documents: mean loss of the answer "
        "tokens, and the share of answers whose every token is the argmax (teacher-forced).",
        "",
        timing_note(results, len(results["runs"])),
        "",
    ]
    return "\n".join(lines)


def plot_rephrase(results: dict[str, Any], target: Path) -> Path:
    """``rephrase.png``: training and validation loss vs step per arm, and the probe per arm."""
    s, runs = results["settings"], results["runs"]
    figure = new_figure((13, 4.5))
    figure.suptitle(
        f"Rephrasing ablation: {s['preset']}, {s['tokens']:,} tokens per arm, "
        f"{s['n_rephrasings']} rephrasings × 1 epoch vs raw × {s['n_rephrasings']} epochs"
    )
    loss_ax, val_ax, probe_ax = figure.subplots(1, 3)
    for run in runs:
        color, label = COLORS[run["arm"]], arm_label(results, run)
        loss_ax.plot(range(1, len(run["loss"]) + 1), run["loss"], color=color, alpha=0.7, label=label)
        plot_val_curve(val_ax, run["val_curve"], color=color, label=label)
    labels = [arm_label(results, run) for run in runs]
    probe = [run["probe_loss"] if run["probe_loss"] is not None else math.nan for run in runs]
    probe_ax.bar(labels, probe, color=[COLORS[run["arm"]] for run in runs])
    loss_ax.set_title("training loss (on each arm's own data)", fontsize=10)
    val_ax.set_title("validation loss on raw held-out text", fontsize=10)
    probe_ax.set_title("QA probe: answer-token loss (lower is better)", fontsize=10)
    for ax in (loss_ax, val_ax):
        finish_axes(ax, "step", "nats/token")
    probe_ax.set_ylabel("nats/token")
    return save_figure_atomically(figure, target)


def print_summary(results: dict[str, Any], console: Console) -> None:
    """The comparison as a rich table."""
    s = results["settings"]
    title = f"rephrasing ablation: {s['preset']}, {s['tokens']:,} tokens per arm"
    console.print(rich_table(title, table_header(), table_rows(results)))


REPORT = Report("rephrase", markdown_report, plot_rephrase, print_summary)
