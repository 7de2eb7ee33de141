"""The ``data`` group: knowledge rephrasing of a corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k2lab.cli.app import app, console

data_app = typer.Typer(help="Pre-training data recipes (K2's knowledge rephrasing).", no_args_is_help=True)


app.add_typer(data_app, name="data")


@data_app.command("rephrase")
def data_rephrase(
    data: Annotated[Path, typer.Option(help="Source corpus: a directory of .txt/.md/.jsonl.")],
    out: Annotated[Path, typer.Option(help="Output corpus directory (texts/, manifest.json).")],
    base_url: Annotated[str, typer.Option(help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")],
    model: Annotated[str, typer.Option(help="Model name at the endpoint.")],
    api_key: Annotated[
        str | None, typer.Option(envvar="OPENAI_API_KEY", help="API key of the endpoint ($OPENAI_API_KEY).")
    ] = None,
    n_rephrasings: Annotated[int, typer.Option(min=1, help="Rephrasings per document.")] = 2,
    chunk_chars: Annotated[int, typer.Option(min=1, help="Characters per chunk (rewritten in turn).")] = 1500,
    tail_chars: Annotated[
        int, typer.Option(min=0, help="Characters of the rephrased text so far shown with each chunk.")
    ] = 600,
    styles: Annotated[
        str, typer.Option(help="Comma-separated styles, one per rephrasing in turn (names or free text).")
    ] = "encyclopedic,textbook,qa,plain",
    fidelity_threshold: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Drop rephrasings whose fidelity score is below this.")
    ] = 0.5,
    judge: Annotated[
        bool, typer.Option("--judge", help="Also ask the endpoint to rate faithfulness (0-10).")
    ] = False,
    concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 4,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="Completion tokens per chunk (default ~chunk chars / 2).")
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0, help="Sampling temperature.")] = 0.7,
    timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 120.0,
    retries: Annotated[int, typer.Option(min=0, help="Retries of a failed request (with backoff).")] = 3,
) -> None:
    """Rewrite a corpus chunk by chunk in diverse styles through an OpenAI-compatible endpoint, verified.

    Each chunk's prompt holds the tail of the rephrased text so far and the next source chunk; a fidelity
    check (content words, names, numbers, length) drops unfaithful rephrasings. Writes OUT/texts/ (a corpus
    directory for `k2lab train --data`) and OUT/manifest.json; documents already done are skipped, and a
    document whose requests keep failing is reported and retried on the next run.
    """
    from k2lab.data.corpus import load_corpus
    from k2lab.data.rephrase import RephraseSettings, rephrase_corpus

    corpus = load_corpus(data, val_fraction=0.0)
    settings = RephraseSettings(
        base_url=base_url, model=model, api_key=api_key, n_rephrasings=n_rephrasings, chunk_chars=chunk_chars,
        tail_chars=tail_chars, styles=tuple(s.strip() for s in styles.split(",") if s.strip()),
        fidelity_threshold=fidelity_threshold, judge=judge, concurrency=concurrency, max_tokens=max_tokens,
        temperature=temperature, timeout=timeout, retries=retries,
    )  # fmt: skip
    console.print(f"rephrasing {len(corpus.train)} documents × {n_rephrasings} through {base_url} → {out}")

    def progress(path: str, entry: dict) -> None:
        if entry["status"] == "failed":
            console.print(f"[red]failed[/] {path}: {entry['error']}", markup=True, highlight=False)
        else:
            scores = ", ".join(f"{r['style']} {r['score']:.2f}{'' if r['kept'] else ' dropped'}"
                               for r in entry["rephrasings"])  # fmt: skip
            console.print(f"done {path}: {scores}", markup=False, highlight=False)

    report = rephrase_corpus(corpus.train, out, settings, on_document=progress)
    console.print(
        f"{report.done} done, {report.skipped} skipped (already done), {report.failed} failed; "
        f"{report.kept} rephrasings kept, {report.dropped} dropped; {report.seconds:.1f}s → {out}"
    )
