"""Text corpora as lists of documents, split into train and validation BY FILE, deterministically.

Two sources:

- the embedded corpus (``load_corpus()``): the running interpreter's standard library, i.e. every
  ``*.py``, ``*.txt`` and ``*.rst`` file under ``sysconfig.get_paths()["stdlib"]`` except those in
  ``site-packages``, ``test``/``tests``, ``idlelib``, ``lib2to3`` and ``__pycache__`` directories
  (about 600 files, 11 MB on CPython 3.11). Every Python install has it, so nothing is downloaded;
- a directory (``load_corpus(path)``): every ``*.txt``, ``*.md`` and ``*.jsonl`` file (any case) under it (hidden
  files and directories skipped). A text file is one document; a JSON-lines file holds one JSON object
  per line whose ``"text"`` field is one document. A UTF-8 byte-order mark opening a file is not text.

The split and the optional byte cap rank files by a SHA-256 of their relative path (never Python's
salted ``hash()``), so the same tree always gives the same corpus; documents are listed in sorted
path order.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from k2lab.errors import K2LabError

STDLIB_SUFFIXES = (".py", ".txt", ".rst")
DIRECTORY_SUFFIXES = (".txt", ".md", ".jsonl")
STDLIB_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


@dataclass(frozen=True)
class Document:
    """One document: ``path`` is the source file relative to the corpus root (``file.jsonl:LINE`` for a
    JSON-lines record), ``text`` its contents."""

    path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents split into ``train`` and ``val`` (disjoint by source file, each sorted by path).

    ``fingerprint`` is a SHA-256 hex digest over every kept file's relative path, split and contents: it
    changes exactly when the documents or the split change, and names cached tokenizers. ``not_utf8``
    lists the files whose bytes are not valid UTF-8 (read with U+FFFD for each undecodable byte), so the
    run's summary line says so instead of training on mangled text unannounced.
    """

    name: str
    root: str
    train: list[Document] = field(repr=False)
    val: list[Document] = field(repr=False)
    fingerprint: str
    num_files: int
    num_bytes: int
    not_utf8: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = (
            f"{self.name}: {self.num_files} files, {self.num_bytes / 1e6:.1f} MB, "
            f"{len(self.train)} train / {len(self.val)} val documents"
        )
        if self.not_utf8:
            text += (
                f"; {len(self.not_utf8)} files are not UTF-8 and their undecodable bytes read as U+FFFD "
                f"(first: {self.not_utf8[0]})"
            )
        return text


def load_corpus(
    path: str | os.PathLike[str] | None = None, val_fraction: float = 0.02, max_bytes: int | None = None
) -> Corpus:
    """Load a corpus: the embedded standard-library corpus when ``path`` is None, else a directory.

    ``val_fraction`` of the files (rounded, at least one when there are two or more files) go to
    validation; ``max_bytes`` keeps a deterministic sample of files whose sizes add up to at most that
    many bytes. Raises ``K2LabError`` with a one-line reason for a missing or empty directory, a bad
    JSON-lines record or a cap that no file fits under.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise K2LabError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        name = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
        files = list_files(root, STDLIB_SUFFIXES, STDLIB_SKIPPED_DIRS)
    else:
        root = Path(path).expanduser()
        name = root.resolve().name or str(root)
        if not root.is_dir():
            reason = "is not a directory" if root.exists() else "does not exist"
            raise K2LabError(f"corpus directory {root} {reason}")
        files = list_files(root, DIRECTORY_SUFFIXES)
    if not files:
        raise K2LabError(f"corpus directory {root} holds no non-empty {'/'.join(DIRECTORY_SUFFIXES)} files")
    if max_bytes is not None:
        files = cap_files(root, files, max_bytes)
    return build_corpus(name, root, files, val_fraction)


def list_files(
    root: Path, suffixes: tuple[str, ...], skipped_dirs: frozenset[str] = frozenset()
) -> list[str]:
    """Relative POSIX paths of the non-empty files under ``root`` with one of ``suffixes`` (in any case: the
    lower-case ``suffixes`` match ``UPPER.TXT``), sorted."""
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skipped_dirs and not d.startswith(".")]
        for file_name in names:
            full = Path(directory, file_name)
            wanted = file_name.lower().endswith(suffixes) and not file_name.startswith(".")  # NOTES.TXT too
            if wanted and full.is_file() and full.stat().st_size > 0:
                found.append(full.relative_to(root).as_posix())
    return sorted(found)


def name_bytes(text: str) -> bytes:
    """``text`` (holding file names) as UTF-8 for a digest; a name whose bytes are not UTF-8, which
    ``os.walk`` gives with its bytes as lone surrogates, gets those bytes back (every UTF-8 name as before)."""
    return text.encode("utf-8", "surrogateescape")


def stable_rank(relative_path: str, purpose: str) -> int:
    """A salt-free 64-bit pseudo-random rank of a file for ``purpose`` ("split" or "sample")."""
    return int.from_bytes(hashlib.sha256(name_bytes(f"{purpose}:{relative_path}")).digest()[:8], "big")


def cap_files(root: Path, files: list[str], max_bytes: int) -> list[str]:
    """Files taken in ``stable_rank(.., "sample")`` order while their sizes fit in ``max_bytes``."""
    kept, total = [], 0
    for relative in sorted(files, key=lambda f: stable_rank(f, "sample")):
        size = (root / relative).stat().st_size
        if total + size <= max_bytes:
            kept.append(relative)
            total += size
    if not kept:
        raise K2LabError(f"max_bytes={max_bytes} is smaller than every corpus file under {root}")
    return sorted(kept)


def split_files(files: list[str], val_fraction: float) -> set[str]:
    """The validation files: the ``round(val_fraction * n)`` (>= 1 if n >= 2) lowest ``split`` ranks."""
    if val_fraction == 0.0 or len(files) < 2:
        return set()
    count = min(len(files) - 1, max(1, math.floor(val_fraction * len(files) + 0.5)))
    return set(sorted(files, key=lambda f: stable_rank(f, "split"))[:count])


def build_corpus(name: str, root: Path, files: list[str], val_fraction: float) -> Corpus:
    """Read ``files`` (sorted) into documents, split them and fingerprint the result."""
    val_files = split_files(files, val_fraction)
    digest = hashlib.sha256()
    train: list[Document] = []
    val: list[Document] = []
    num_bytes = 0
    not_utf8 = []
    for relative in files:
        data = read_bytes(root / relative)
        num_bytes += len(data)
        text = decode_text(data)
        if text is None:
            not_utf8.append(relative)
            text = data.decode("utf-8-sig", errors="replace")
        in_val = relative in val_files
        digest.update(name_bytes(f"{relative}\0{'val' if in_val else 'train'}\0{len(data)}\0"))
        if data.startswith(codecs.BOM_UTF8):  # its text lost the BOM: tokenizers cached for it with one go
            digest.update(b"bom\0")
        digest.update(hashlib.sha256(data).digest())
        (val if in_val else train).extend(parse_documents(relative, text, root))
    if not train and not val:
        raise K2LabError(f"corpus directory {root} holds no text (every record is empty)")
    return Corpus(name, str(root), train, val, digest.hexdigest(), len(files), num_bytes, tuple(not_utf8))


def decode_text(data: bytes) -> str | None:
    """``data`` decoded as UTF-8 without a leading byte-order mark (U+FEFF, which some editors write), or None
    where it is not valid UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def read_bytes(file: Path) -> bytes:
    """The file's bytes; an unreadable file is a one-line ``K2LabError``."""
    try:
        return file.read_bytes()
    except OSError as error:
        raise K2LabError(f"corpus file {file} cannot be read ({error.strerror or error})") from error


def parse_documents(relative: str, text: str, root: Path) -> list[Document]:
    """The documents in one file: the whole text, or one per JSON-lines record (blank lines skipped)."""
    if not relative.lower().endswith(".jsonl"):
        return [Document(relative, text)]
    documents = []
    # JSON lines end at \n only: str.splitlines also splits at U+2028, U+0085 or a form feed, which JSON
    # strings may hold raw (json.dumps(..., ensure_ascii=False) writes them), and broke valid records
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            record = parse_record(line, root / relative, number)
            if record:
                documents.append(Document(f"{relative}:{number}", record))
    return documents


def parse_record(line: str, file: Path, number: int) -> str:
    """The ``"text"`` string of one JSON-lines record; anything else is a ``K2LabError`` naming the line."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise K2LabError(f"{file}:{number} is not valid JSON ({error})") from error
    if not isinstance(record, dict):
        raise K2LabError(f"{file}:{number} should be a JSON object, not {type(record).__name__}")
    if not isinstance(record.get("text"), str):
        raise K2LabError(f'{file}:{number} should have a string "text" field')
    refuse_surrogates(record["text"], f"{file}:{number}")  # valid JSON ("\\ud83d") but no Unicode text
    return record["text"]


def refuse_surrogates(text: str, where: str) -> None:
    """``K2LabError`` naming the first lone surrogate in ``text``: a Python ``str`` but no Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start : error.end].encode("utf-8", "backslashreplace").decode()
        raise K2LabError(
            f"{where} contains {bad} at character {error.start}, a lone surrogate, which is not valid Unicode"
        ) from None
