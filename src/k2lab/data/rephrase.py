"""K2's knowledge rephrasing: rewrite a corpus through an LLM, chunk by chunk, in diverse styles, verified.

Each document is split into chunks of at most ``chunk_chars`` characters at paragraph, then sentence, then
word boundaries (``split_chunks``: the chunks concatenate back to the document exactly). A rephrasing is
produced **autoregressively**: the prompt for chunk ``i`` holds a bounded tail (``tail_chars``) of the
rephrased text so far and source chunk ``i``, so the rewrite stays coherent across chunks while every
request stays short. Rephrasing ``k`` of a document uses style ``styles[k % len(styles)]`` (encyclopedic,
textbook, Q&A, plain-language, ...), so the ``n_rephrasings`` versions present the same knowledge
differently.

Requests go to any OpenAI-compatible endpoint through the official ``openai`` client (``base_url``):
k2lab's own ``k2lab serve``, vLLM, SGLang or a hosted API. Connection errors, timeouts, 429 and 5xx answers
are retried with exponential backoff; a document whose requests still fail is marked ``failed`` in the
manifest (with the error) and the run goes on; when an earlier run had done it (a rerun asking for more
rephrasings), its earlier entry and files are kept instead. Failed and unfinished documents are redone by
the next run; ``done`` ones whose source text is unchanged (and that have enough rephrasings) are skipped.

A **fidelity check** compares every rephrasing with its source (``fidelity``): recall of the source's
content words, named entities (capitalised words) and numbers, precision of the rephrasing's numbers (no
invented figures) and a length-ratio bound; the score is the mean of the applicable parts (0 outside the
length bounds). Rephrasings scoring below ``fidelity_threshold`` are dropped. With ``judge=True`` the same
endpoint also rates faithfulness 0-10, and a rephrasing must also reach ``judge_threshold``.

Output (``out``): ``texts/<document>/r<k>-<style>.txt`` for every kept rephrasing (a corpus directory that
``k2lab.data.corpus.load_corpus`` and the trainer read), dropped ones under the hidden ``.dropped/`` (which
``load_corpus`` skips), and ``manifest.json`` (written atomically after every document): per document its
status, source hash, chunk count, error, and per rephrasing its style, file, fidelity scores and verdict.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, model_validator

from k2lab.data.corpus import Document
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text

__all__ = [
    "NUMBER",
    "SENTENCE_END",
    "STYLES",
    "ChatEndpoint",
    "OpenAIEndpoint",
    "RephraseSettings",
    "build_messages",
    "fidelity",
    "rephrase_corpus",
    "rephrase_document",
    "split_chunks",
]

STYLES: dict[str, str] = {
    "encyclopedic": "an encyclopedia article: neutral, precise, third person, well organised",
    "textbook": "a textbook section: explain step by step for a student, defining terms as they appear",
    "qa": "questions and answers: a series of 'Q:' questions each followed by an 'A:' answer that together "
    "cover every fact",
    "plain": "a plain-language explanation for a general reader: short sentences, everyday words",
    "notes": "concise study notes: bullet points that keep every fact, name and number",
    "dialogue": "a conversation between a curious student and an expert that conveys every fact",
}
DEFAULT_STYLES = ("encyclopedic", "textbook", "qa", "plain")
MANIFEST = "manifest.json"
# the settings a document's rephrasings depend on: an output directory holds rephrasings of one such set
# (n_rephrasings aside: more of them redo a document; the endpoint, concurrency and retries change no text)
OUTPUT_SETTINGS = (
    "model", "chunk_chars", "tail_chars", "styles", "fidelity_threshold", "min_length_ratio",
    "max_length_ratio", "judge", "judge_threshold", "max_tokens", "temperature", "seed",
)  # fmt: skip
SYSTEM_PROMPT = (
    "You rewrite text in a requested style. Keep every fact, name, number and claim of the source; add no "
    "new information; do not repeat text that was already rewritten. Reply with the rewritten text only."
)
STOPWORDS = frozenset(
    """a about above after again against all also am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have having
    he her here hers him his how i if in into is it its itself just more most my no nor not now of off on once
    only or other our ours out over own same she should so some such than that the their theirs them then there
    these they this those through to too under until up very was we were what when where which while who whom
    why will with would you your yours may might must shall one two also thus therefore however""".split()  # noqa: SIM905
)


class ChatEndpoint(Protocol):
    """Anything that completes a chat: ``complete(messages, max_tokens, seed) -> text``."""

    def complete(self, messages: list[dict[str, str]], max_tokens: int, seed: int) -> str: ...


class RephraseSettings(BaseModel):
    """How to rephrase: endpoint, rephrasings per document, chunking, styles, fidelity, retries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
    model: str = Field(description="Model name at the endpoint.")
    api_key: str | None = Field(None, description="API key of the endpoint.")
    n_rephrasings: int = Field(2, description="Rephrasings per document.")
    chunk_chars: int = Field(1500, description="Characters per chunk (rewritten in turn).")
    tail_chars: int = Field(600, description="Characters of the rephrased text so far shown with each chunk.")
    styles: tuple[str, ...] = Field(
        DEFAULT_STYLES, description="Styles, one per rephrasing in turn (names or free text)."
    )
    fidelity_threshold: float = Field(0.5, description="Drop rephrasings whose fidelity score is below this.")
    min_length_ratio: float = Field(0.3, description="Shortest rephrasing kept, as a fraction of its source.")
    max_length_ratio: float = Field(3.0, description="Longest rephrasing kept, as a multiple of its source.")
    judge: bool = Field(False, description="Also ask the endpoint to rate faithfulness (0-10).")
    judge_threshold: float = Field(0.6, description="Judge rating (0-1 of 10) a kept rephrasing reaches.")
    concurrency: int = Field(4, description="Requests in flight.")
    max_tokens: int | None = Field(
        None, description="Completion tokens per chunk; none: about half the chunk's characters + 16."
    )
    temperature: float = Field(0.7, description="Sampling temperature (0-2).")
    timeout: float = Field(120.0, description="Seconds per request.")
    retries: int = Field(3, description="Retries of a failed request (with backoff).")
    backoff: float = Field(1.0, description="Seconds before the first retry (doubling after).")
    seed: int = Field(0, description="Sampling seed (per document and rephrasing).")

    @model_validator(mode="after")
    def _check(self) -> RephraseSettings:
        if self.n_rephrasings < 1 or self.chunk_chars < 1 or self.concurrency < 1 or self.retries < 0:
            raise K2LabError("n_rephrasings, chunk_chars and concurrency must be positive, retries >= 0")
        if not self.styles:
            raise K2LabError("at least one style is needed")
        if not 0.0 <= self.fidelity_threshold <= 1.0:
            raise K2LabError(f"fidelity_threshold must be in [0, 1], got {self.fidelity_threshold}")
        if self.tail_chars < 0 or self.min_length_ratio > self.max_length_ratio:
            raise K2LabError("tail_chars must be >= 0 and min_length_ratio <= max_length_ratio")
        if (self.max_tokens is not None and self.max_tokens < 1) or not 0.0 <= self.temperature <= 2.0:
            raise K2LabError("max_tokens must be positive and temperature in [0, 2]")
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise K2LabError(
                f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, not {self.base_url!r}"
            )
        return self

    def output_record(self) -> dict[str, Any]:
        """The settings that shape what is written (``OUTPUT_SETTINGS``), as the manifest records them."""
        return {
            name: value for name, value in self.model_dump(mode="json").items() if name in OUTPUT_SETTINGS
        }

    def style_text(self, name: str) -> str:
        """The instruction of a style: a known name's description, or the name itself as free text."""
        return STYLES.get(name, name)


class EndpointError(Exception):
    """A request that failed for good (after retries, or a non-retryable error)."""


# ---- chunking and prompts --------------------------------------------------------------------------------
#: The end of a sentence (terminal punctuation, optional closing quote or bracket, whitespace).
SENTENCE_END = re.compile(r"[.!?;:][\"')\]]?\s+")


def _cut(window: str) -> int:
    """Where to end a chunk inside ``window`` (a full-size window): the last paragraph break, else the
    last sentence end, else the last whitespace, past its first quarter; else all of it (a hard cut)."""
    least = len(window) // 4
    paragraph = window.rfind("\n\n")
    if paragraph >= least:
        return paragraph + 2
    sentences = [m.end() for m in SENTENCE_END.finditer(window) if m.end() > least]
    if sentences:
        return sentences[-1]
    space = max(window.rfind(" "), window.rfind("\n"))
    return space + 1 if space >= least else len(window)


def split_chunks(text: str, chunk_chars: int) -> list[str]:
    """``text`` as chunks of at most ``chunk_chars`` characters, cut at paragraph / sentence / word
    boundaries where possible; ``"".join(chunks) == text``."""
    if chunk_chars < 1:
        raise K2LabError(f"chunk_chars must be positive, got {chunk_chars}")
    chunks, start = [], 0
    while len(text) - start > chunk_chars:
        end = start + _cut(text[start : start + chunk_chars])
        chunks.append(text[start:end])
        start = end
    if start < len(text):
        chunks.append(text[start:])
    return chunks


def bounded_tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text``, starting at a word boundary when one is near."""
    if len(text) <= limit:
        return text
    tail = text[-limit:] if limit else ""
    space = tail.find(" ")
    return tail[space + 1 :] if 0 <= space < limit // 4 else tail


def build_messages(style: str, chunk: str, tail: str, index: int, total: int) -> list[dict[str, str]]:
    """The chat for chunk ``index`` of ``total``: the style, the rephrased tail so far, the source chunk."""
    previous = (
        f"The rewrite so far ends with:\n<rewritten_so_far>\n{tail}\n</rewritten_so_far>\n\n"
        "Continue it seamlessly."
        if tail
        else "This is the beginning of the document."
    )
    user = (
        f"Rewrite the text in the style of {style}.\n\n{previous}\n\n"
        f"Part {index + 1} of {total} of the original text:\n<source>\n{chunk}\n</source>\n\n"
        "Rewrite this part only."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def _assemble(piece: str, source_chunk: str) -> str:
    """The model's text for a chunk, stripped, with the source chunk's surrounding whitespace restored
    (so paragraphs stay apart and an exact echo reassembles to the source)."""
    body = piece.strip()
    lead = source_chunk[: len(source_chunk) - len(source_chunk.lstrip())]
    trail = source_chunk[len(source_chunk.rstrip()) :]
    return lead + body + trail if body else ""


# ---- the endpoint ----------------------------------------------------------------------------------------
class EmptyReply(Exception):
    """An answer with no text (HTTP 200, empty content): a failed request, not an empty rewrite."""


class OpenAIEndpoint:
    """Chat completions through the official ``openai`` client, retried with exponential backoff."""

    def __init__(self, settings: RephraseSettings, sleep: Callable[[float], None] = time.sleep) -> None:
        import openai  # lazy: optional dependency openai

        self.settings, self.sleep, self.openai = settings, sleep, openai
        self.client = openai.OpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key or "EMPTY",
            timeout=settings.timeout,
            max_retries=0,
        )

    def _retryable(self, error: Exception) -> bool:
        openai = self.openai
        if isinstance(error, EmptyReply):
            return True
        if isinstance(error, openai.APIConnectionError | openai.RateLimitError | openai.InternalServerError):
            return True
        return isinstance(error, openai.APIStatusError) and error.status_code >= 500

    def _request(self, messages: list[dict[str, str]], max_tokens: int, seed: int) -> str:
        """One request's text; ``EmptyReply`` when it has none (an answer of whitespace counted as done
        work: every rephrasing dropped, exit 0, and the next run skipped the documents)."""
        s = self.settings
        reply = self.client.chat.completions.create(
            model=s.model, messages=messages, max_tokens=max_tokens, temperature=s.temperature, seed=seed
        )
        text = reply.choices[0].message.content or ""
        if not text.strip():
            raise EmptyReply(
                f"the endpoint answered with no text (finish_reason {reply.choices[0].finish_reason})"
            )
        return text

    def complete(self, messages: list[dict[str, str]], max_tokens: int, seed: int) -> str:
        """The assistant's text; ``EndpointError`` once the retries are spent or on a client error."""
        s = self.settings
        for attempt in range(s.retries + 1):
            try:
                return self._request(messages, max_tokens, seed)
            except (self.openai.APIError, EmptyReply) as error:
                if not self._retryable(error) or attempt == s.retries:
                    raise EndpointError(f"{type(error).__name__}: {error}") from error
                self.sleep(s.backoff * 2**attempt * (1 + random.random() * 0.1))
        raise EndpointError("unreachable")  # pragma: no cover


# ---- fidelity --------------------------------------------------------------------------------------------
_WORD = re.compile(r"[^\W\d_][\w'-]*", re.UNICODE)
#: A number as the fidelity check compares them (digits with optional , or . groups).
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


FIDELITY_WEIGHTS = {
    "content_recall": 2.0,
    "entity_recall": 1.0,
    "number_recall": 1.0,
    "number_precision": 1.0,
}


def _content_words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text) if len(w) >= 3 and w.lower() not in STOPWORDS}


def _entities(text: str) -> set[str]:
    """Capitalised words (names, places, acronyms) that are not stopwords, lower-cased."""
    return {w.lower() for w in _WORD.findall(text) if w[0].isupper() and w.lower() not in STOPWORDS}


def _numbers(text: str) -> set[str]:
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def _recall(source: set[str], other: set[str]) -> float | None:
    return len(source & other) / len(source) if source else None


def fidelity(source: str, rephrased: str, min_ratio: float = 0.3, max_ratio: float = 3.0) -> dict[str, Any]:
    """Cheap local faithfulness scores of ``rephrased`` against ``source``.

    ``content_recall`` / ``entity_recall`` / ``number_recall``: share of the source's content words /
    capitalised words / numbers found in the rephrasing; ``number_precision``: share of the rephrasing's
    numbers found in the source; ``length_ratio``: characters rephrased / source. ``score`` is the mean
    of the parts that apply (a part whose set is empty does not) weighted by ``FIDELITY_WEIGHTS`` (content
    words count double, so one or two small numbers cannot carry a text), and 0 when the length ratio is
    outside ``[min_ratio, max_ratio]``.
    """
    ratio = len(rephrased) / max(1, len(source))
    numbers_out = _numbers(rephrased)
    parts = {
        "content_recall": _recall(_content_words(source), _content_words(rephrased)),
        "entity_recall": _recall(_entities(source), {w.lower() for w in _WORD.findall(rephrased)}),
        "number_recall": _recall(_numbers(source), numbers_out),
        "number_precision": _recall(numbers_out, _numbers(source)),
    }
    present = {key: value for key, value in parts.items() if value is not None}
    weight = sum(FIDELITY_WEIGHTS[key] for key in present)
    in_bounds = min_ratio <= ratio <= max_ratio
    mean = sum(FIDELITY_WEIGHTS[key] * value for key, value in present.items()) / weight if present else 1.0
    score = mean if in_bounds else 0.0
    return {**parts, "length_ratio": ratio, "length_ok": in_bounds, "score": score}


JUDGE_PROMPT = (
    "Rate how faithfully the REWRITE preserves the facts of the SOURCE (no fact lost, changed or invented), "
    "from 0 (unrelated or wrong) to 10 (fully faithful). Reply with the number only.\n\n"
    "SOURCE:\n{source}\n\nREWRITE:\n{rewrite}"
)


def judge_score(
    endpoint: ChatEndpoint, source: str, rewrite: str, seed: int, limit: int = 4000
) -> float | None:
    """The endpoint's 0-10 faithfulness rating as a fraction in [0, 1] (None when the reply has no number)."""
    prompt = JUDGE_PROMPT.format(source=source[:limit], rewrite=rewrite[:limit])
    reply = endpoint.complete([{"role": "user", "content": prompt}], 8, seed)
    match = re.search(r"\d+(?:\.\d+)?", reply)
    return min(1.0, float(match.group()) / 10) if match else None


# ---- one document ----------------------------------------------------------------------------------------
def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big") % 2**31


def _max_tokens(settings: RephraseSettings, chunk: str) -> int:
    return settings.max_tokens or len(chunk) // 2 + 16


def rephrase_once(
    endpoint: ChatEndpoint, settings: RephraseSettings, chunks: Sequence[str], style: str, seed: int
) -> str:
    """One autoregressive rephrasing of a chunked document in ``style`` (``EndpointError`` on failure)."""
    text = ""
    for index, chunk in enumerate(chunks):
        if not chunk.strip():  # nothing to rewrite (an empty answer is a failure)
            text += chunk
            continue
        tail = bounded_tail(text, settings.tail_chars)
        messages = build_messages(settings.style_text(style), chunk, tail, index, len(chunks))
        piece = endpoint.complete(messages, _max_tokens(settings, chunk), _seed(seed, index))
        text += _assemble(piece, chunk)
    return text


def rephrase_document(
    endpoint: ChatEndpoint, settings: RephraseSettings, document: Document, k: int
) -> dict[str, Any]:
    """Rephrasing ``k`` of ``document``: its text, style, fidelity scores and verdict (raises EndpointError)."""
    style = settings.styles[k % len(settings.styles)]
    start = time.perf_counter()
    chunks = split_chunks(document.text, settings.chunk_chars)
    seed = _seed(settings.seed, document.path, k)
    text = rephrase_once(endpoint, settings, chunks, style, seed)
    scores = fidelity(document.text, text, settings.min_length_ratio, settings.max_length_ratio)
    kept = scores["score"] >= settings.fidelity_threshold
    if settings.judge:
        scores["judge"] = judge_score(endpoint, document.text, text, seed)
        scores["judge_ok"] = scores["judge"] is None or scores["judge"] >= settings.judge_threshold
        kept = kept and scores["judge_ok"]
    return {
        "index": k,
        "style": style,
        "text": text,
        "chunks": len(chunks),
        "fidelity": scores,
        "score": scores["score"],
        "kept": kept,
        "chars": len(text),
        "seconds": time.perf_counter() - start,
    }


# ---- the corpus ------------------------------------------------------------------------------------------
def document_slug(path: str) -> str:
    """A file-system-safe, unique folder name for a document path (``dir/a.jsonl:3`` -> ``dir__a.jsonl-3``)."""
    safe = re.sub(r"[^\w.-]+", "-", path.replace("/", "__")).strip("-.") or "doc"
    return f"{safe[:80]}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def source_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_same_settings(out: Path, manifest: dict[str, Any], settings: RephraseSettings) -> None:
    """Refuse (``K2LabError``) to add to ``out`` rephrasings made with other ``OUTPUT_SETTINGS`` than its
    manifest records: a re-run with other styles counted the earlier texts as done and rewrote the recorded
    settings, so the manifest no longer described the texts on disk."""
    recorded = manifest.get("settings")
    if not manifest["documents"] or not isinstance(recorded, dict):
        return
    wanted = settings.output_record()
    changed = [name for name in OUTPUT_SETTINGS if name in recorded and recorded[name] != wanted[name]]
    if changed:
        name = changed[0]
        raise K2LabError(
            f"{out} holds rephrasings made with other settings ({name}: {recorded[name]!r} there, "
            f"{wanted[name]!r} now{', and more' if len(changed) > 1 else ''}); choose a new --out, or run "
            "with the settings its manifest.json records"
        )


def read_manifest(out: Path) -> dict[str, Any]:
    """The manifest in ``out`` (an empty one when there is none)."""
    path = out / MANIFEST
    if not path.is_file():
        return {"version": 1, "documents": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise K2LabError(f"{path} is not valid JSON ({error}); remove it to start over") from error
    data.setdefault("documents", {})
    return data


@dataclass
class _Progress:
    """Rephrasings of one document collected as they finish."""

    document: Document
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


@dataclass
class RephraseReport:
    """What a run did: documents done, skipped (already done), failed; rephrasings kept and dropped."""

    out: str
    done: int = 0
    skipped: int = 0
    failed: int = 0
    kept: int = 0
    dropped: int = 0
    failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_endpoint(self) -> None:
        """``K2LabError`` when every document this run tried failed: nothing came back, so the endpoint
        (unreachable, wrong model, refusing) is at fault, not the documents."""
        if self.failed and not self.done:
            first = next(iter(self.failures.values()))
            raise K2LabError(f"every document this run tried failed ({self.failed}); the first: {first}")


class _Writer:
    """Writes a finished document's files and its manifest entry (the manifest atomically, under a lock)."""

    def __init__(self, out: Path, manifest: dict[str, Any], settings: RephraseSettings) -> None:
        self.out, self.manifest, self.lock = out, manifest, threading.Lock()
        settings_record = settings.model_dump()
        settings_record.pop("api_key")
        self.manifest["settings"] = settings_record

    def finish(self, progress: _Progress, report: RephraseReport) -> dict[str, Any]:
        """Record a finished document; returns this run's entry of it. A failed redo leaves an earlier done
        entry and its files as they were (a rerun against a dead endpoint deleted them): only a successful
        redo replaces them, and the returned failed entry says how many were kept (``kept_earlier``)."""
        document = progress.document
        slug = document_slug(document.path)
        entry: dict[str, Any] = {
            "source_sha256": source_hash(document.text),
            "chars": len(document.text),
            "slug": slug,
        }
        if progress.errors:
            entry.update(status="failed", error=progress.errors[0], rephrasings=[])
        else:
            for folder in ("texts", ".dropped"):  # an earlier run's files of this document are stale now
                shutil.rmtree(self.out / folder / slug, ignore_errors=True)
            entry.update(
                status="done", rephrasings=[self._write(slug, r) for _, r in sorted(progress.results.items())]
            )
        with self.lock:
            earlier = self.manifest["documents"].get(document.path)
            if entry["status"] == "failed" and earlier is not None and earlier.get("status") == "done":
                entry["kept_earlier"] = len(earlier.get("rephrasings", []))
            else:
                self.manifest["documents"][document.path] = entry
            self._count(entry, document.path, report)
            atomic_write_text(self.out / MANIFEST, json.dumps(self.manifest, indent=2) + "\n")
        return entry

    def _write(self, slug: str, result: dict[str, Any]) -> dict[str, Any]:
        folder = Path("texts" if result["kept"] else ".dropped") / slug
        style = re.sub(r"[^\w-]+", "-", result["style"])[:40]
        relative = folder / f"r{result['index']}-{style}.txt"
        atomic_write_text(self.out / relative, result["text"])
        record = {key: value for key, value in result.items() if key != "text"}
        return {**record, "file": relative.as_posix()}

    @staticmethod
    def _count(entry: dict[str, Any], path: str, report: RephraseReport) -> None:
        if entry["status"] == "failed":
            report.failed += 1
            report.failures[path] = entry["error"]
            return
        report.done += 1
        kept = sum(r["kept"] for r in entry["rephrasings"])
        report.kept += kept
        report.dropped += len(entry["rephrasings"]) - kept


def is_done(entry: dict[str, Any] | None, document: Document, settings: RephraseSettings) -> bool:
    """Whether the manifest entry already holds this document's rephrasings (same text, enough of them)."""
    return (
        entry is not None
        and entry.get("status") == "done"
        and entry.get("source_sha256") == source_hash(document.text)
        and len(entry.get("rephrasings", [])) >= settings.n_rephrasings
    )


class _Stoppable:
    """An endpoint that sends no more requests once ``stop`` is set: an interrupted run (Ctrl-C) kept
    sending every queued request, then threw the answers away."""

    def __init__(self, endpoint: ChatEndpoint, stop: threading.Event) -> None:
        self.endpoint, self.stop = endpoint, stop

    def complete(self, messages: list[dict[str, str]], max_tokens: int, seed: int) -> str:
        if self.stop.is_set():
            raise EndpointError("the run was interrupted")
        return self.endpoint.complete(messages, max_tokens, seed)


def _collect(
    pool: ThreadPoolExecutor,
    endpoint: ChatEndpoint,
    settings: RephraseSettings,
    todo: Sequence[Document],
    writer: _Writer,
    report: RephraseReport,
    on_document: Callable[[str, dict[str, Any]], None] | None,
) -> None:
    """Rephrase ``todo`` on ``pool``, writing each document (and calling ``on_document``) as it finishes."""
    progress = {d.path: _Progress(d) for d in todo}
    futures = {
        pool.submit(rephrase_document, endpoint, settings, d, k): (d.path, k)
        for d in todo
        for k in range(settings.n_rephrasings)
    }
    for future in as_completed(futures):
        path, k = futures[future]
        state = progress[path]
        try:
            state.results[k] = future.result()
        except Exception as error:  # an endpoint or unexpected failure fails the document, not the run
            state.errors.append(f"rephrasing {k}: {type(error).__name__}: {error}")
        if len(state.results) + len(state.errors) == settings.n_rephrasings:
            entry = writer.finish(state, report)
            if on_document is not None:
                on_document(path, entry)


def rephrase_corpus(
    documents: Sequence[Document],
    out: str | Path,
    settings: RephraseSettings,
    endpoint: ChatEndpoint | None = None,
    on_document: Callable[[str, dict[str, Any]], None] | None = None,
) -> RephraseReport:
    """Rephrase every document ``settings.n_rephrasings`` times into ``out`` (see the module docstring).

    Documents already done in ``out/manifest.json`` are skipped; ``on_document(path, entry)`` is called as
    each one finishes (done or failed). Never raises for an endpoint failure: the document is failed (an
    earlier run's rephrasings of it, when it was done, are kept). An
    interrupt (``KeyboardInterrupt``, also from ``on_document``) sends no further request and starts no
    queued one; the documents finished so far stay recorded, the rest are redone by the next run.
    """
    out = Path(out)
    start = time.perf_counter()
    endpoint = endpoint or OpenAIEndpoint(settings)
    manifest = read_manifest(out)
    check_same_settings(out, manifest, settings)
    writer = _Writer(out, manifest, settings)
    report = RephraseReport(out=str(out))
    todo = [d for d in documents if not is_done(manifest["documents"].get(d.path), d, settings)]
    report.skipped = len(documents) - len(todo)
    stop = threading.Event()
    pool = ThreadPoolExecutor(settings.concurrency)
    try:
        _collect(pool, _Stoppable(endpoint, stop), settings, todo, writer, report, on_document)
    finally:  # on an interrupt: no new request, nothing queued starts; requests in flight end first
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
    report.seconds = time.perf_counter() - start
    with writer.lock:
        manifest["last_run"] = report.to_dict()
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return report


def passes(record: dict[str, Any], threshold: float | None = None) -> bool:
    """A manifest rephrasing's verdict: as recorded, or re-decided from its score at ``threshold``."""
    if threshold is None:
        return bool(record.get("kept"))
    return record["score"] >= threshold and record["fidelity"].get("judge_ok", True)


def kept_rephrasings(
    out: str | Path, threshold: float | None = None
) -> dict[str, list[tuple[dict[str, Any], str]]]:
    """Per source document path, its kept rephrasings as (manifest record, text), in rephrasing order.

    ``threshold`` re-decides the fidelity verdicts from the recorded scores (the files of dropped
    rephrasings are kept, under ``.dropped/``), so a corpus can be reused at another threshold.
    """
    out = Path(out)
    manifest = read_manifest(out)
    kept: dict[str, list[tuple[dict[str, Any], str]]] = {}
    for path, entry in manifest["documents"].items():
        if entry.get("status") != "done":
            continue
        records = [r for r in entry.get("rephrasings", []) if passes(r, threshold)]
        kept[path] = [(r, (out / r["file"]).read_text(encoding="utf-8")) for r in records]
    return kept
