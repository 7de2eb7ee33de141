"""The ``data`` group: knowledge rephrasing of a corpus, run from ``RephraseRun`` (``RephraseSettings`` plus
the source and output directories), and K2.5's zero-vision SFT trajectories (``ZeroVisionConfig``)."""

from __future__ import annotations

from pathlib import Path

import typer
from pydantic import Field
from rich.markup import escape

from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.data.rephrase import RephraseSettings
from k2lab.errors import K2LabError
from k2lab.fsutil import holds
from k2lab.interrupt import reports_interrupt
from k2lab.vision.text_trajectories import ZeroVisionConfig

data_app = typer.Typer(
    help="Data recipes: K2's knowledge rephrasing, K2.5's zero-vision SFT trajectories.", no_args_is_help=True
)


app.add_typer(data_app, name="data")


class RephraseRun(RephraseSettings):
    """What ``k2lab data rephrase`` runs: the rephrasing settings, the source corpus and the output."""

    data: Path = Field(description="Source corpus: a directory of .txt/.md/.jsonl.")
    out: Path = Field(description="Output corpus directory (texts/, manifest.json).")

    def settings(self) -> RephraseSettings:
        """The rephrasing settings alone (what the manifest records)."""
        return RephraseSettings(**self.model_dump(exclude={"data", "out"}))


@data_app.command("rephrase")
@runs_config(
    RephraseRun,
    options={
        "data": Opt("data"),
        "out": Opt("out"),
        "base_url": Opt("base_url"),
        "model": Opt("model"),
        "api_key": Opt("api_key", envvar="OPENAI_API_KEY"),
        "n_rephrasings": Opt("n_rephrasings"),
        "chunk_chars": Opt("chunk_chars"),
        "tail_chars": Opt("tail_chars"),
        "styles": Opt("styles", sep=","),
        "fidelity_threshold": Opt("fidelity_threshold"),
        "judge": Opt("judge"),
        "concurrency": Opt("concurrency"),
        "max_tokens": Opt("max_tokens"),
        "temperature": Opt("temperature"),
        "timeout": Opt("timeout"),
        "retries": Opt("retries"),
    },
)
def data_rephrase(config: RephraseRun) -> None:
    """Rewrite a corpus chunk by chunk in diverse styles through an OpenAI-compatible endpoint, verified.

    Each chunk's prompt holds the tail of the rephrased text so far and the next source chunk; a fidelity
    check (content words, names, numbers, length) drops unfaithful rephrasings. Writes OUT/texts/ (a corpus
    directory for `k2lab train --data`) and OUT/manifest.json (OUT outside DATA); documents already done are
    skipped, and a document whose requests keep failing (or answer nothing) is reported and retried on the
    next run.
    """
    from k2lab.data.corpus import load_corpus
    from k2lab.data.rephrase import MANIFEST, read_manifest, rephrase_corpus

    out = config.out
    if holds(config.data, out):
        raise K2LabError(
            f"--out {out} is inside --data {config.data}: every rerun would rephrase the rephrasings again; "
            "choose an --out outside it"
        )
    corpus = load_corpus(config.data, val_fraction=0.0)
    console.print(f"corpus: {corpus}", markup=False, highlight=False)  # says which files are not UTF-8
    console.print(
        f"rephrasing {len(corpus.train)} documents × {config.n_rephrasings} through {config.base_url} → {out}"
    )

    def progress(path: str, entry: dict) -> None:
        if entry["status"] == "failed":
            kept = entry.get("kept_earlier")
            note = f" (the {kept} rephrasings of an earlier run are kept)" if kept is not None else ""
            console.print(
                f"[red]failed[/] {path}: {escape(entry['error'])}{note}", markup=True, highlight=False
            )
        else:
            scores = ", ".join(f"{r['style']} {r['score']:.2f}{'' if r['kept'] else ' dropped'}"
                               for r in entry["rephrasings"])  # fmt: skip
            console.print(f"done {path}: {scores}", markup=False, highlight=False)

    def kept() -> str:
        done = sum(entry.get("status") == "done" for entry in read_manifest(out)["documents"].values())
        return f"{done} rephrased documents (recorded in {MANIFEST})"

    with reports_interrupt(out, kept, "run the same command again to rephrase the rest"):
        report = rephrase_corpus(corpus.train, out, config.settings(), on_document=progress)
    console.print(
        f"{report.done} done, {report.skipped} skipped (already done), {report.failed} failed; "
        f"{report.kept} rephrasings kept, {report.dropped} dropped; {report.seconds:.1f}s → {out}"
    )
    report.check_endpoint()


@data_app.command("zero-vision")
@runs_config(
    ZeroVisionConfig,
    options={"out": Opt("out"), "count": Opt("count"), "seed": Opt("seed"), "tasks": Opt("tasks", sep=",")},
)
def data_zero_vision(config: ZeroVisionConfig) -> None:
    """Write K2.5 zero-vision SFT trajectories (JSONL for `k2lab sft --data`): the perceptual questions of
    the synthetic visual tasks (counting, grounding boxes and points, segmentation, OCR, charts) about a
    scene given as text, each answered by a short Python program, its printed output and the answer in the
    format the visual rewards read. The same seed writes the same file.
    """
    from k2lab.vision.text_trajectories import write_zero_vision

    path = write_zero_vision(config)
    console.print(
        f"{config.count} zero-vision trajectories ({', '.join(config.tasks)}) → {path}", markup=False
    )
