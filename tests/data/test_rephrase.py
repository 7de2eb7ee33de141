"""K2's knowledge rephrasing: chunking, autoregressive prompts, styles, fidelity, the output corpus, resume
and failures against a recording echo endpoint on loopback; the real k2lab server with a tiny random
model; and a tiny end-to-end `k2lab ablate rephrase`."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from k2lab.data.corpus import Document, load_corpus
from k2lab.data.rephrase import (
    RephraseSettings,
    build_messages,
    fidelity,
    kept_rephrasings,
    rephrase_corpus,
    split_chunks,
)
from k2lab.errors import K2LabError
from tests.ablations.test_optimizer import PNG_MAGIC, run_cli
from tests.conftest import randomize, serving

openai = pytest.importorskip("openai")

SOURCE_RE = re.compile(r"<source>\n(.*)\n</source>", re.S)
TAIL_RE = re.compile(r"<rewritten_so_far>\n(.*)\n</rewritten_so_far>", re.S)
FACTS = (
    "Marie Curie was born in Warsaw in 1867. She moved to Paris in 1891 to study physics.\n\n"
    "In 1903 she shared the Nobel Prize in Physics with Pierre Curie and Henri Becquerel. "
    "She won a second Nobel Prize, in Chemistry, in 1911.\n\n"
    "The element polonium, discovered in 1898, is named after Poland."
)


class EchoEndpoint:
    """A recording OpenAI-compatible app: echoes the prompt's source chunk, or answers garbage or nothing
    (whitespace), or fails; each answer after ``delay`` seconds."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.mode = "echo"
        self.delay = 0.0
        self.fail_marker = "FAIL-ME"
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.complete)

    async def complete(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        await asyncio.sleep(self.delay)
        prompt = body["messages"][-1]["content"]
        if self.fail_marker in prompt:
            return JSONResponse(status_code=503, content={"error": {"message": "overloaded", "type": "x"}})
        match = SOURCE_RE.search(prompt)
        if self.mode == "empty":
            text = " \n"
        elif self.mode == "garbage" or match is None:
            text = "bananas are yellow and tasty fruit " * 3 if match else "7"
        else:
            text = match.group(1)
        message = {"role": "assistant", "content": text}
        return {
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }  # fmt: skip


@pytest.fixture(scope="module")
def echo():
    endpoint = EchoEndpoint()
    with serving(endpoint.app) as base:
        endpoint.base = f"{base}/v1"
        yield endpoint


def settings(base: str, **fields) -> RephraseSettings:
    values = dict(
        base_url=base, model="echo", n_rephrasings=3, chunk_chars=80, tail_chars=60, concurrency=2,
        backoff=0.0, retries=1,
    )  # fmt: skip
    return RephraseSettings(**{**values, **fields})


def test_chunks_cut_at_boundaries_and_reassemble():
    chunks = split_chunks(FACTS, 80)
    assert "".join(chunks) == FACTS and all(len(c) <= 80 for c in chunks)
    assert chunks[0] == "Marie Curie was born in Warsaw in 1867. "  # a sentence end, not mid-word
    assert chunks[1].endswith("\n\n")  # a paragraph break wins where there is one
    assert all(c[-1].isspace() or c is chunks[-1] for c in chunks)
    assert split_chunks("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]  # no boundary: hard cuts
    assert split_chunks("short", 100) == ["short"]


def test_autoregressive_prompts_styles_and_exact_assembly(echo, tmp_path):
    echo.requests.clear()
    docs = [Document("bio/curie.txt", FACTS)]
    config = settings(echo.base, styles=("encyclopedic", "qa"), concurrency=1)
    report = rephrase_corpus(docs, tmp_path, config)
    assert (report.done, report.kept, report.dropped, report.failed) == (1, 3, 0, 0)
    chunks = split_chunks(FACTS, 80)
    assert len(echo.requests) == 3 * len(chunks)
    by_style: dict[str, list[str]] = {}
    for body in echo.requests:
        prompt = body["messages"][-1]["content"]
        style = "encyclopedic" if "encyclopedia" in prompt else "qa"
        by_style.setdefault(style, []).append(prompt)
    assert sorted(len(p) for p in by_style.values()) == [len(chunks), 2 * len(chunks)]  # r0, r2 / r1
    prompts = by_style["qa"]
    for index, prompt in enumerate(prompts):  # chunk i's prompt: the rephrased tail so far + source chunk i
        assert SOURCE_RE.search(prompt).group(1) == chunks[index]
        assert f"Part {index + 1} of {len(chunks)}" in prompt
        tail = TAIL_RE.search(prompt)
        if index == 0:
            assert tail is None and "beginning of the document" in prompt
        else:
            so_far = "".join(chunks[:index])  # the echo's rephrasing so far is the source so far
            assert so_far.endswith(tail.group(1)) and 0 < len(tail.group(1)) <= 60
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["documents"]["bio/curie.txt"]
    assert [r["style"] for r in entry["rephrasings"]] == ["encyclopedic", "qa", "encyclopedic"]
    assert all(r["kept"] and r["score"] == 1.0 and r["chunks"] == len(chunks) for r in entry["rephrasings"])
    for record in entry["rephrasings"]:
        assert (tmp_path / record["file"]).read_text() == FACTS  # an echo reassembles the source exactly
    corpus = load_corpus(tmp_path, val_fraction=0.0)
    assert len(corpus.train) == 3 and all(d.text == FACTS for d in corpus.train)
    assert "api_key" not in manifest["settings"]


def test_fidelity_keeps_a_faithful_text_and_drops_an_unfaithful_one():
    assert fidelity(FACTS, FACTS)["score"] == 1.0
    paraphrase = (
        "Born in Warsaw (1867), Marie Curie went to Paris in 1891 for physics. Her 1903 Nobel Prize in "
        "Physics was shared with Pierre Curie and Henri Becquerel; in 1911 came a Nobel Prize in Chemistry. "
        "Polonium, found in 1898, honours Poland, where the element was named after."
    )
    assert fidelity(FACTS, paraphrase)["score"] > 0.6
    wrong = fidelity(FACTS, "Bananas grow in 1492 on trees in tropical regions and are yellow when ripe.")
    assert wrong["score"] < 0.2 and wrong["number_precision"] == 0.0
    assert fidelity(FACTS, "Curie.")["score"] == 0.0  # far too short
    messages = build_messages("plain words", "SRC", "TAIL", 1, 3)
    assert "<source>\nSRC\n</source>" in messages[1]["content"] and "TAIL" in messages[1]["content"]


def test_unfaithful_output_is_dropped_resume_skips_and_failures_do_not_stop_the_run(echo, tmp_path):
    docs = [Document(f"d{i}.txt", FACTS.replace("1867", str(1800 + i))) for i in range(3)]
    echo.mode = "garbage"
    try:
        report = rephrase_corpus(docs[:1], tmp_path, settings(echo.base, n_rephrasings=2))
    finally:
        echo.mode = "echo"
    assert (report.done, report.kept, report.dropped) == (1, 0, 2)
    entry = json.loads((tmp_path / "manifest.json").read_text())["documents"]["d0.txt"]
    assert all(not r["kept"] and r["score"] < 0.5 for r in entry["rephrasings"])
    assert all(
        (tmp_path / r["file"]).is_file() and r["file"].startswith(".dropped/") for r in entry["rephrasings"]
    )
    assert kept_rephrasings(tmp_path) == {"d0.txt": []}
    assert len(kept_rephrasings(tmp_path, threshold=0.0)["d0.txt"]) == 2  # re-decided from the scores

    # Resume: d0 is done (skipped); d1 fails (503 retried, then failed); d2 goes through.
    failing = Document("d1.txt", docs[1].text + " FAIL-ME")
    echo.requests.clear()
    report = rephrase_corpus([docs[0], failing, docs[2]], tmp_path, settings(echo.base, n_rephrasings=2))
    assert (report.skipped, report.done, report.failed, report.kept) == (1, 1, 1, 2)
    assert "InternalServerError" in report.failures["d1.txt"] or "503" in report.failures["d1.txt"]
    prompts = [b["messages"][-1]["content"] for b in echo.requests]
    assert not any("1800" in p for p in prompts)  # d0 was not asked again
    assert sum("FAIL-ME" in p for p in prompts) == 2 * 2  # 2 rephrasings × (1 try + 1 retry) of chunk 0
    documents = json.loads((tmp_path / "manifest.json").read_text())["documents"]
    assert documents["d1.txt"]["status"] == "failed" and documents["d2.txt"]["status"] == "done"
    assert len(load_corpus(tmp_path, val_fraction=0.0).train) == 2  # only d2's kept rephrasings

    # A later run retries the failed document only.
    echo.requests.clear()
    report = rephrase_corpus([docs[0], docs[1], docs[2]], tmp_path, settings(echo.base, n_rephrasings=2))
    assert (report.skipped, report.done, report.failed) == (2, 1, 0)


def test_cli_rephrase_against_the_k2lab_server(small_tokenizer, tmp_path, capsys):
    from k2lab import build_model, load_preset
    from k2lab.serve import Engine
    from k2lab.serve.server import build_app

    model = randomize(build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=2048)))
    engine = Engine(model, max_batch=8).start()
    data = tmp_path / "raw"
    data.mkdir()
    (data / "a.txt").write_text("hello there, how are you? " * 3)
    (data / "b.jsonl").write_text(json.dumps({"text": 'the "city": "Paris", days 3.'}) + "\n")
    out = tmp_path / "rephrased"
    try:
        with serving(build_app(engine, small_tokenizer, "nano")) as base:
            args = (
                "data",
                "rephrase",
                "--data",
                data,
                "--out",
                out,
                "--base-url",
                f"{base}/v1",
                "--model",
                "nano",
            )
            flags = ("--n-rephrasings", 2, "--chunk-chars", 40, "--max-tokens", 12, "--fidelity-threshold", 0)
            assert run_cli(*args, *flags, "--styles", "textbook,qa") == 0
    finally:
        engine.shutdown()
    printed = capsys.readouterr().out
    assert "2 done, 0 skipped (already done), 0 failed" in " ".join(printed.split())
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["documents"]) == {"a.txt", "b.jsonl:1"}
    for entry in manifest["documents"].values():
        assert entry["status"] == "done" and [r["style"] for r in entry["rephrasings"]] == ["textbook", "qa"]
        assert all(0.0 <= r["score"] <= 1.0 for r in entry["rephrasings"])


def test_ablate_rephrase_end_to_end(echo, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "ablation"
    args = (
        "ablate",
        "rephrase",
        "--data",
        tiny_corpus,
        "--out",
        out,
        "--base-url",
        echo.base,
        "--model",
        "echo",
    )
    small = ("--preset", "k2-nano", "--vocab-size", 300, "--docs", 4, "--doc-chars", 300, "--seq-len", 32)
    tail = ("--batch-size", 2, "--n-rephrasings", 2, "--threads", 1, "--jobs", 1, "--probe-items", 8)
    assert run_cli(*args, *small, *tail) == 0
    results = json.loads((out / "rephrase.json").read_text())
    arms = {run["arm"]: run for run in results["runs"]}
    assert set(arms) == {"raw", "rephrased"} and results["same_tokens"]
    assert arms["raw"]["steps"] == arms["rephrased"]["steps"] == results["settings"]["steps"]
    assert results["rephrasing"]["kept_fraction"] == 1.0  # an echo is faithful
    for run in arms.values():
        assert run["final_val_loss"] > 0 and run["probe_loss"] > 0
    assert (out / "rephrase.png").read_bytes()[:8] == PNG_MAGIC
    assert "| raw × 2 epochs |" in (out / "rephrase.md").read_text()
    assert arms["raw"]["epochs"] == pytest.approx(2.0, rel=0.1)

    # Reusing the rephrased corpus: same data, so both runs (and their probes) are reused.
    assert run_cli(*args[:-4], "--rephrased", out / "rephrased", *small, *tail) == 0
    again = json.loads((out / "rephrase.json").read_text())
    assert [run["reused"] for run in again["runs"]] == [True, True]
    assert again["runs"][1]["probe_loss"] == arms["rephrased"]["probe_loss"]


def test_cli_rephrase_runs_a_recipe_with_free_text_styles(tmp_path, monkeypatch):
    """`data rephrase` runs a RephraseRun: recipe < --set < options, --styles split at commas only (a free-text
    style keeps its spaces), and the library receives RephraseSettings alone (what the manifest records)."""
    import k2lab.data.rephrase as rephrase
    from k2lab.data.rephrase import RephraseReport

    seen = []
    monkeypatch.setattr(
        rephrase,
        "rephrase_corpus",
        lambda docs, out, s, on_document: seen.append(s) or RephraseReport(str(out)),
    )
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(FACTS)
    recipe = tmp_path / "rephrase.toml"
    recipe.write_text(
        f'data = "{tmp_path / "corpus"}"\nout = "{tmp_path / "out"}"\nmodel = "m"\nretries = 5\n'
    )
    args = ("data", "rephrase", "--recipe", recipe, "--set", "n_rephrasings=3", "--base-url", "http://x/v1")
    assert run_cli(*args, "--styles", "qa, a limerick about it", "--judge") == 0
    assert seen == [
        RephraseSettings(
            base_url="http://x/v1",
            model="m",
            retries=5,
            n_rephrasings=3,
            styles=("qa", "a limerick about it"),
            judge=True,
        )
    ]
    assert type(seen[0]) is RephraseSettings
    assert run_cli("data", "rephrase", "--recipe", recipe, "--base-url", "u", "--temperature", "3") == 2


@pytest.mark.parametrize("url", ["notaurl", "ftp://x/v1", "http://"])
def test_base_url_must_be_an_http_url(url):
    with pytest.raises(K2LabError, match="base_url must be an http"):
        settings(url)


def test_an_output_of_other_settings_is_refused_untouched(echo, tmp_path):
    """A re-run with other styles counted the earlier texts as done and rewrote the manifest's settings."""
    docs = [Document("d0.txt", FACTS)]
    rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2, styles=("qa", "wiki")))
    manifest = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(K2LabError, match=r"other settings \(styles: \['qa', 'wiki'\] there, \['qa'\] now\)"):
        rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2, styles=("qa",)))
    assert (tmp_path / "manifest.json").read_bytes() == manifest
    more = rephrase_corpus(
        docs, tmp_path, settings(echo.base, n_rephrasings=3, styles=("qa", "wiki"), retries=0)
    )
    assert more.done == 1  # more rephrasings (or another endpoint or concurrency) redo a document


def test_cli_fails_when_every_document_failed(echo, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(FACTS + " FAIL-ME")
    args = ("data", "rephrase", "--data", tmp_path / "corpus", "--out", tmp_path / "out", "--model", "echo")
    assert run_cli(*args, "--base-url", echo.base, "--retries", "0", "--set", "backoff=0.0") == 2


def test_ablate_rephrase_fails_when_the_endpoint_returns_nothing(tiny_corpus, tmp_path, monkeypatch, capsys):
    from k2lab.ablations import rephrase as study

    real = study.rephrase_settings
    monkeypatch.setattr(study, "rephrase_settings", lambda *a: real(*a).model_copy(update={"retries": 0}))
    closed = f"http://127.0.0.1:{study.free_port()}/v1"  # nothing listens there
    out = tmp_path / "ablation"
    args = ("ablate", "rephrase", "--data", tiny_corpus, "--out", out, "--base-url", closed, "--model", "m")
    small = ("--preset", "k2-nano", "--vocab-size", 300, "--docs", 2, "--doc-chars", 300, "--seq-len", 32)
    assert run_cli(*args, *small, "--threads", 1, "--jobs", 1) == 2  # was 0: the raw text against itself
    assert "every document this run tried failed (2)" in capsys.readouterr().err
    assert not (out / "rephrase.json").exists() and not (out / "runs").exists()


def test_an_interrupt_sends_no_more_requests_and_keeps_the_finished_documents(echo, tmp_path):
    """Ctrl-C let the pool send every queued request (50 after the interrupt in the probe), then threw the
    answers away; now at most the requests in flight (one per worker) end, and finished documents stay."""
    docs = [Document(f"d{i}.txt", FACTS.replace("1867", str(1800 + i))) for i in range(6)]
    finished: list[str] = []
    at_interrupt = []

    def interrupt(path: str, entry: dict) -> None:
        finished.append(path)
        if len(finished) == 2:
            at_interrupt.append(len(echo.requests))
            raise KeyboardInterrupt

    echo.requests.clear()
    echo.delay = 0.05  # the workers must not finish everything before the interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2), on_document=interrupt)
    finally:
        echo.delay = 0.0
    assert len(echo.requests) - at_interrupt[0] <= 2  # concurrency 2: was every remaining request (~40)
    documents = json.loads((tmp_path / "manifest.json").read_text())["documents"]
    assert sorted(documents) == sorted(finished) and all(e["status"] == "done" for e in documents.values())
    again = rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2))
    assert (again.skipped, again.done) == (2, 4)


def test_a_failed_redo_keeps_the_earlier_rephrasings(echo, tmp_path):
    """A rerun asking for more rephrasings against a dead endpoint deleted the texts already done and marked
    the document failed; now the earlier entry and files stay until a redo succeeds."""
    from k2lab.ablations.rephrase import free_port

    docs = [Document("d0.txt", FACTS)]
    rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2))
    files = sorted(p.relative_to(tmp_path) for p in (tmp_path / "texts").rglob("*.txt"))
    before = json.loads((tmp_path / "manifest.json").read_text())["documents"]
    outcomes = []
    dead = settings(f"http://127.0.0.1:{free_port()}/v1", n_rephrasings=3, retries=0)
    report = rephrase_corpus(docs, tmp_path, dead, on_document=lambda path, entry: outcomes.append(entry))
    assert (report.failed, report.done) == (1, 0) and "Connection" in report.failures["d0.txt"]
    assert outcomes[0]["status"] == "failed" and outcomes[0]["kept_earlier"] == 2
    assert json.loads((tmp_path / "manifest.json").read_text())["documents"] == before
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "texts").rglob("*.txt")) == files
    redo = rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=3))
    assert (redo.done, redo.kept) == (1, 3) and len(list((tmp_path / "texts").rglob("*.txt"))) == 3


def test_an_empty_reply_is_a_failed_request(echo, tmp_path):
    """HTTP 200 with no text counted as done work (every rephrasing dropped, exit 0) and the next run skipped
    the documents; now it is retried like other failures, then the document fails."""
    docs = [Document("d0.txt", FACTS)]
    echo.requests.clear()
    echo.mode = "empty"
    try:
        report = rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2))
    finally:
        echo.mode = "echo"
    assert (report.done, report.failed) == (0, 1) and "EmptyReply" in report.failures["d0.txt"]
    assert len(echo.requests) == 2 * 2  # 2 rephrasings × (1 try + 1 retry) of chunk 0
    with pytest.raises(K2LabError, match="every document this run tried failed"):
        report.check_endpoint()
    again = rephrase_corpus(docs, tmp_path, settings(echo.base, n_rephrasings=2))
    assert (again.skipped, again.done, again.kept) == (0, 1, 2)


def test_cli_refuses_an_out_inside_the_data(tmp_path, capsys):
    """--out inside --data rephrased its own output on every rerun (2, then 6, then 14 documents)."""
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text(FACTS)
    for out in (data / "rephrased", data):
        args = ("data", "rephrase", "--data", data, "--out", out, "--model", "m", "--base-url", "http://x/v1")
        assert run_cli(*args) == 2
        assert "is inside --data" in " ".join(capsys.readouterr().err.split())
    assert sorted(p.name for p in data.iterdir()) == ["a.txt"]


def test_cli_says_which_files_are_not_utf8(echo, tmp_path, capsys):
    """A binary or non-UTF-8 file was sent to the endpoint (its bad bytes as U+FFFD) without a word; the
    command now prints the corpus line `k2lab train` prints, which names such files."""
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "a.txt").write_text(FACTS)
    (data / "b.txt").write_bytes(FACTS.encode() + b"\xff\xfe caf\xe9\n")
    args = ("data", "rephrase", "--data", data, "--out", tmp_path / "out", "--model", "echo")
    assert run_cli(*args, "--base-url", echo.base, "--n-rephrasings", 1) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "1 files are not UTF-8 and their undecodable bytes read as U+FFFD (first: b.txt)" in printed


def test_ablate_rephrase_refuses_an_out_inside_the_data(tiny_corpus, capsys):
    out = tiny_corpus / "study"  # its rephrased/ and data/ would be read as raw documents by the next run
    assert (
        run_cli("ablate", "rephrase", "--data", tiny_corpus, "--out", out, "--base-url", "http://x/v1") == 2
    )
    assert "is inside --data" in capsys.readouterr().err and not out.exists()
