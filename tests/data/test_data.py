"""The data pipeline: corpus split, byte-level BPE tokenizer and its cache, packing, resume, baseline."""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path

import pytest
import tokenizers
import torch

from k2lab.data import (
    SPECIAL_TOKENS,
    Corpus,
    Document,
    PackedBatches,
    load_corpus,
    load_tokenizer,
    train_tokenizer,
    unigram_baseline,
    validation_batches,
)
from k2lab.data.corpus import STDLIB_SKIPPED_DIRS, stable_rank
from k2lab.data.tokenizer import (
    MAX_TRAIN_WORD_CHARS,
    XTML_TOKENS,
    bounded_words,
    min_vocab_size,
    train_bpe,
    training_sample,
)
from k2lab.errors import K2LabError

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "packing",
    "tokens",
    "into",
    "windows",
    "of",
    "text",
]


def write_corpus(root: Path, num_files: int = 40) -> Path:
    """``num_files`` small text files (some Markdown, in a subdirectory) plus files that are ignored."""
    for i in range(num_files):
        folder = root / ("notes" if i % 3 == 0 else "")
        folder.mkdir(parents=True, exist_ok=True)
        text = " ".join(WORDS[(i * j) % len(WORDS)] for j in range(30 + i)) + f"\nfile {i}: déjà vu, 世界.\n"
        (folder / f"doc{i:02d}.{'md' if i % 3 == 0 else 'txt'}").write_text(text, encoding="utf-8")
    (root / "ignored.py").write_text("print('not a corpus file')\n")
    (root / ".hidden.txt").write_text("hidden\n")
    (root / "empty.txt").write_text("")
    return root


def source(document: Document) -> str:
    return document.path.split(":")[0]


class CharTokenizer:
    """A stand-in tokenizer for exact packing arithmetic: id = code point, EOS = 0."""

    eos_id = 0
    vocab_size = 128

    def encode_batch(self, texts, allow_special=True):
        return [[ord(c) for c in text] for text in texts]


def docs(*texts: str) -> list[Document]:
    return [Document(f"d{i}", text) for i, text in enumerate(texts)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return load_corpus(write_corpus(tmp_path_factory.mktemp("corpus")), val_fraction=0.1)


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return train_tokenizer(corpus, vocab_size=300, cache_dir=tmp_path_factory.mktemp("cache"))


# ---------------------------------------------------------------- corpus


def test_split_is_deterministic_disjoint_and_by_file(tmp_path, corpus):
    again = load_corpus(Path(corpus.root), val_fraction=0.1)
    assert [d.path for d in again.train] == [d.path for d in corpus.train]
    assert [d.path for d in again.val] == [d.path for d in corpus.val]
    assert again.fingerprint == corpus.fingerprint and len(corpus.fingerprint) == 64
    train, val = {d.path for d in corpus.train}, {d.path for d in corpus.val}
    assert not train & val and len(val) == 4 and len(train | val) == corpus.num_files == 40
    assert all(
        p.endswith((".txt", ".md")) and not p.startswith(".") and p != "empty.txt" for p in train | val
    )
    assert [d.path for d in corpus.train] == sorted(train) and [d.path for d in corpus.val] == sorted(val)
    assert "notes/doc00.md" in train | val
    # A copy elsewhere (same relative paths and contents) gives the same split and fingerprint.
    copy = write_corpus(tmp_path / "copy")
    assert load_corpus(copy, val_fraction=0.1).fingerprint == corpus.fingerprint
    assert load_corpus(copy, val_fraction=0.2).fingerprint != corpus.fingerprint
    (copy / "doc01.txt").write_text("changed", encoding="utf-8")
    assert load_corpus(copy, val_fraction=0.1).fingerprint != corpus.fingerprint


def test_jsonl_strings_may_hold_raw_line_separators(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+0085 and form feeds raw; splitlines() cut the records."""
    texts = ["a\u2028b", "c\u0085d", "e\x0cf"]
    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\n"
    )
    (tmp_path / "b.txt").write_text("plain text")
    loaded = load_corpus(tmp_path, val_fraction=0.5)
    assert {d.path: d.text for d in loaded.train + loaded.val if d.path.startswith("a")} == {
        f"a.jsonl:{i}": t for i, t in enumerate(texts, start=1)
    }


def test_jsonl_records_are_documents_of_one_split(tmp_path):
    lines = [json.dumps({"text": f"record {i}", "id": i}) for i in range(3)]
    (tmp_path / "a.jsonl").write_text("\n".join([lines[0], "", lines[1], lines[2]]) + "\n")
    (tmp_path / "b.txt").write_text("plain text")
    loaded = load_corpus(tmp_path, val_fraction=0.5)
    by_path = {d.path: d.text for d in loaded.train + loaded.val}
    assert by_path == {
        "a.jsonl:1": "record 0",
        "a.jsonl:3": "record 1",
        "a.jsonl:4": "record 2",
        "b.txt": "plain text",
    }
    for split in (loaded.train, loaded.val):
        assert len({source(d) for d in split}) == 1  # one file each: the records stay together


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "should be a JSON object, not list"),
        ('{"txt": "x"}', '"text"'),
        ('{"text": "ok \\ud83d x"}', r"contains \\ud83d at character 3, a lone surrogate"),  # valid JSON
    ],
    ids=["bad-json", "not-object", "no-text", "lone-surrogate"],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, reason):
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(K2LabError, match=reason) as error:
        load_corpus(tmp_path)
    assert f"{tmp_path / 'data.jsonl'}:2" in str(error.value) and "\n" not in str(error.value)


def test_missing_or_empty_directory_is_a_clear_error(tmp_path):
    with pytest.raises(K2LabError, match="does not exist"):
        load_corpus(tmp_path / "nowhere")
    with pytest.raises(K2LabError, match="holds no non-empty .txt/.md/.jsonl files"):
        load_corpus(tmp_path)
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(K2LabError, match="is not a directory"):
        load_corpus(tmp_path / "f.txt")
    with pytest.raises(K2LabError, match="val_fraction"):
        load_corpus(tmp_path, val_fraction=1.0)


def test_files_that_are_not_utf8_are_named_in_the_corpus_line(tmp_path):
    (tmp_path / "good.txt").write_text("caf\u00e9 ok")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 latin-1".encode("latin-1"))
    corpus = load_corpus(tmp_path, val_fraction=0.0)
    assert corpus.not_utf8 == ("latin1.txt",)
    assert "1 files are not UTF-8" in str(corpus) and "latin1.txt" in str(corpus)
    assert sorted(d.text for d in corpus.train) == ["caf\u00e9 ok", "caf\ufffd latin-1"]
    (tmp_path / "latin1.txt").unlink()
    assert "UTF-8" not in str(load_corpus(tmp_path, val_fraction=0.0))


def test_a_file_name_that_is_not_utf8_is_read_and_ranks_as_before(tmp_path):
    """b"caf\\xe9.txt" (Latin-1) was a UnicodeEncodeError traceback in the split and the fingerprint; every
    UTF-8 name keeps its rank, so the splits of existing corpora do not move."""
    (tmp_path / "good.txt").write_text("good text")
    Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.txt")).write_text("latin-1 name")
    corpus = load_corpus(tmp_path, val_fraction=0.5)
    assert sorted(d.text for d in corpus.train + corpus.val) == ["good text", "latin-1 name"]
    state = PackedBatches(corpus.train + corpus.val, CharTokenizer(), 1, 4).state_dict()
    assert len(state["documents"]) == 16
    expected = int.from_bytes(hashlib.sha256("split:d\u00e9j\u00e0/vu.txt".encode()).digest()[:8], "big")
    assert stable_rank("d\u00e9j\u00e0/vu.txt", "split") == expected


def test_upper_case_extensions_are_corpus_files_too(tmp_path):
    """UPPER.TXT and RECORDS.JSONL were skipped in silence."""
    (tmp_path / "lower.txt").write_text("lower")
    (tmp_path / "UPPER.TXT").write_text("upper")
    (tmp_path / "RECORDS.JSONL").write_text('{"text": "record"}\n')
    corpus = load_corpus(tmp_path, val_fraction=0.0)
    assert sorted(d.text for d in corpus.train) == ["lower", "record", "upper"]


def test_a_byte_order_mark_is_not_text(tmp_path):
    """A .txt kept U+FEFF as its first character; a .jsonl was refused ("Unexpected UTF-8 BOM")."""
    (tmp_path / "plain.txt").write_text("same")
    plain = load_corpus(tmp_path, val_fraction=0.0).fingerprint
    (tmp_path / "plain.txt").write_bytes(b"\xef\xbb\xbfsame")
    (tmp_path / "records.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    corpus = load_corpus(tmp_path, val_fraction=0.0)
    assert [(d.path, d.text) for d in corpus.train] == [
        ("plain.txt", "same"),
        ("records.jsonl:1", "a"),
        ("records.jsonl:2", "b"),
    ]
    (tmp_path / "records.jsonl").unlink()
    assert load_corpus(tmp_path, val_fraction=0.0).fingerprint != plain  # no cached tokenizer of the old text


def test_max_bytes_keeps_a_deterministic_sample(corpus):
    capped = load_corpus(Path(corpus.root), val_fraction=0.1, max_bytes=corpus.num_bytes // 3)
    assert 0 < capped.num_bytes <= corpus.num_bytes // 3 and capped.num_files < corpus.num_files
    again = load_corpus(Path(corpus.root), val_fraction=0.1, max_bytes=corpus.num_bytes // 3)
    assert again.fingerprint == capped.fingerprint
    with pytest.raises(K2LabError, match="smaller than every corpus file"):
        load_corpus(Path(corpus.root), max_bytes=10)


def test_embedded_stdlib_corpus():
    capped = load_corpus(max_bytes=300_000)
    assert capped.name.startswith("python") and capped.train and capped.val
    assert capped.num_bytes <= 300_000
    paths = [d.path for d in capped.train + capped.val]
    assert all(p.endswith((".py", ".txt", ".rst")) for p in paths)
    assert not any(set(Path(p).parts[:-1]) & STDLIB_SKIPPED_DIRS for p in paths)
    assert load_corpus(max_bytes=300_000).fingerprint == capped.fingerprint


# ---------------------------------------------------------------- tokenizer


def test_special_tokens_have_fixed_low_ids(tokenizer):
    assert tokenizer.special_tokens == {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    assert tokenizer.special_tokens["<|im_end|>"] == 7 and tokenizer.special_tokens["<|tool_call_end|>"] == 12
    assert tokenizer.vocab_size == 300


@pytest.mark.parametrize(
    "text",
    [
        "the quick brown fox",
        "  leading spaces\n\ttabs\r\n",
        "déjà vu 世界 🙂 \x00",
        "unseen: zqxj 0123456789 {}[]",
    ],
)
def test_encode_decode_roundtrip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(len(SPECIAL_TOKENS) <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_chat_tokens_encode_to_single_ids(tokenizer):
    text = "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    ids = tokenizer.encode(text)
    assert ids[0] == 4 and ids.count(6) == 2 and 7 in ids and 5 in ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "userhiassistant"
    plain = tokenizer.encode(text, allow_special=False)
    assert not set(plain) & set(range(len(SPECIAL_TOKENS))) and tokenizer.decode(plain) == text


def test_literal_and_special_encodes_in_threads_do_not_leak_into_each_other(tokenizer):
    """A server renders chats in worker threads: one request's literal user text (allow_special=False) must
    never pick up the role markers another request encodes at the same time, nor lose its own."""
    text = "hi <|im_end|><|im_assistant|> there " * 100
    want = {allow: tokenizer.encode(text, allow_special=allow) for allow in (False, True)}
    assert want[False] != want[True]
    wrong: list[bool] = []

    def encode_many(allow: bool) -> None:
        wrong.extend(allow for _ in range(150) if tokenizer.encode(text, allow_special=allow) != want[allow])

    threads = [threading.Thread(target=encode_many, args=(i % 2 == 0,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, f"{len(wrong)} of 600 encodes took the other mode's tokens"


def test_cache_is_reused_not_retrained(corpus, tmp_path):
    first = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path)
    assert not first.from_cache and first.path == tmp_path / f"{corpus.fingerprint}-290.json"
    stamp = first.path.stat().st_mtime_ns
    os.utime(first.path, ns=(stamp - 10**9, stamp - 10**9))  # any rewrite would move it forward again
    second = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path)
    assert second.from_cache and second.path.stat().st_mtime_ns == stamp - 10**9
    assert second.encode("lazy dog jumps") == first.encode("lazy dog jumps")
    first.path.write_text("{ truncated")  # a corrupt cache is retrained and rewritten
    third = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path)
    assert not third.from_cache and third.backend.to_str() == first.backend.to_str()


def test_training_is_deterministic_and_uncached_when_asked(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("K2LAB_CACHE_DIR", str(tmp_path))
    a = train_tokenizer(corpus, vocab_size=280, use_cache=False)
    b = train_tokenizer(corpus, vocab_size=280, use_cache=False)
    assert a.backend.to_str() == b.backend.to_str() and a.path is None and not any(tmp_path.iterdir())
    with pytest.raises(K2LabError, match=f"at least {256 + len(SPECIAL_TOKENS)}"):
        train_tokenizer(corpus, vocab_size=100)


# Recorded from k2lab's tokenizer code before the K3 family existed (tokenizers 0.23.3), on this corpus.
K2_TOKENIZER_SHA256 = "12734c081d3869b1ec05d599ace5c6bcb430f31d703295bbff36322c12fd69c5"
K2_IDS = [101, 275, 238, 93, 82, 107, 106, 280, 297, 298, 274, 96, 92, 86, 95, 100, 29, 238, 85, 145, 120, 91,
          145, 272, 238, 103, 102, 238, 178, 134, 262, 181, 261, 252, 7]  # fmt: skip


def test_a_k2_tokenizer_is_byte_identical_to_before_under_its_old_name(corpus, tokenizer):
    """K2's tokenizer is unchanged by the K3 family: the same file, the same ids, the same cache name."""
    if tokenizers.__version__ == "0.23.3":  # another tokenizers release may write the JSON differently
        assert hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest() == K2_TOKENIZER_SHA256
    assert tokenizer.encode("the lazy dog packing tokens, déjà vu 世界<|im_end|>") == K2_IDS
    assert tokenizer.path.name == f"{corpus.fingerprint}-300.json"
    reference = train_bpe(training_sample(corpus, 64 * 2**20), 300, SPECIAL_TOKENS)
    assert tokenizer.backend.to_str() == reference.to_str()  # the BPE of SPECIAL_TOKENS alone
    assert list(tokenizer.special_tokens) == list(SPECIAL_TOKENS) and min_vocab_size() == 274


def test_a_tokenizers_fingerprint_follows_its_ids_not_its_file(corpus, tokenizer, tmp_path):
    """What checkpoints record to refuse a resume with another tokenizer: the same after a save and load,
    another for a BPE trained on other text or of another size."""
    tokenizer.save(tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path / "tokenizer.json").fingerprint == tokenizer.fingerprint
    other = Corpus(**{**vars(corpus), "train": corpus.train[1:]})
    assert train_tokenizer(other, 300, use_cache=False).fingerprint != tokenizer.fingerprint
    assert train_tokenizer(corpus, 290, use_cache=False).fingerprint != tokenizer.fingerprint


def test_a_long_line_without_white_space_trains_in_linear_time():
    """One pre-token's training time grew with its square: 100 KB took 6 s, 300 KB a minute, 3 MB did not
    finish. Runs of non-space characters now train as words of at most MAX_TRAIN_WORD_CHARS; the saved
    tokenizer pre-tokenizes as before (byte-level alone)."""
    import random

    generator = random.Random(1)
    text = "".join(generator.choice("abcdefghij") for _ in range(300_000))
    training = tokenizers.pre_tokenizers.Sequence(
        [bounded_words(), tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    words = [word for word, _ in training.pre_tokenize_str(text)]
    assert (
        "".join(words) == text and max(map(len, words)) == MAX_TRAIN_WORD_CHARS
    )  # the mechanism, not a timing
    backend = train_bpe([text], 400)  # about 0.4 s here; a minute before
    assert json.loads(backend.to_str())["pre_tokenizer"]["type"] == "ByteLevel"


def test_a_k3_tokenizer_carries_the_xtml_tokens_within_its_vocabulary(corpus, tokenizer, tmp_path):
    k3 = train_tokenizer(corpus, vocab_size=300, cache_dir=tmp_path, family="k3")
    assert k3.vocab_size == tokenizer.vocab_size == 300  # four merges fewer, not four ids more
    assert k3.special_tokens == {token: i for i, token in enumerate((*SPECIAL_TOKENS, *XTML_TOKENS))}
    assert k3.path == tmp_path / f"{corpus.fingerprint}-300-k3.json"
    # the same merges as K2's but the last four, each id four higher
    k2_vocab, k3_vocab = tokenizer.backend.get_vocab(), k3.backend.get_vocab()
    k2_words = sorted((w for w in k2_vocab if k2_vocab[w] >= 18), key=k2_vocab.get)
    assert sorted((w for w in k3_vocab if k3_vocab[w] >= 22), key=k3_vocab.get) == k2_words[:-4]
    text = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
    assert k3.encode(text)[0] == 18 and k3.decode(k3.encode(text)) == text
    assert len(k3.encode("<|end_of_msg|>")) == 1 < len(tokenizer.encode("<|end_of_msg|>"))  # K2: plain text
    with pytest.raises(K2LabError, match="at least 278"):
        train_tokenizer(corpus, vocab_size=276, family="k3")
    with pytest.raises(K2LabError, match="unknown tokenizer family 'k4'"):
        train_tokenizer(corpus, vocab_size=300, family="k4")


def test_neither_familys_cache_file_is_taken_for_the_other(corpus, tmp_path):
    k2 = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path)
    k3_path = tmp_path / f"{corpus.fingerprint}-290-k3.json"
    k3_path.write_text(k2.path.read_text())  # a K2 tokenizer under the K3 name: retrained, not loaded
    k3 = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path, family="k3")
    assert not k3.from_cache and list(k3.special_tokens)[-4:] == list(XTML_TOKENS)
    k2.path.write_text(k3_path.read_text())  # and the other way round
    again = train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path)
    assert not again.from_cache and list(again.special_tokens) == list(SPECIAL_TOKENS)
    assert train_tokenizer(corpus, vocab_size=290, cache_dir=tmp_path, family="k3").from_cache


def test_save_and_load_tokenizer(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path)
    assert loaded.special_tokens == tokenizer.special_tokens and loaded.eos_id == 2
    assert loaded.encode("over a lazy dog") == tokenizer.encode("over a lazy dog")
    with pytest.raises(K2LabError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(K2LabError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


# ---------------------------------------------------------------- packing


def test_packing_shapes_eos_and_label_shift():
    batches = PackedBatches(
        docs("abc", "de", "fghij"), CharTokenizer(), batch_size=2, seq_len=4, shuffle=False
    )
    stream = [ord(c) if c != "|" else 0 for c in "abc|de|fghij|" * 3]
    first, second = next(batches), next(batches)
    assert first.input_ids.shape == first.labels.shape == (2, 4) and first.input_ids.dtype == torch.int64
    assert first.segment_ids is None
    rows = torch.cat([first.input_ids, second.input_ids]).flatten().tolist()
    assert rows == stream[:16]  # stride T: every token is an input once ...
    labels = torch.cat([first.labels, second.labels]).flatten().tolist()
    assert labels == stream[1:17]  # ... and a label once, one step later
    assert first.input_ids[0].tolist() == [97, 98, 99, 0]  # EOS after "abc"


def test_segment_ids_number_documents_within_each_window():
    batches = PackedBatches(
        docs("abc", "de", "fghij"),
        CharTokenizer(),
        batch_size=3,
        seq_len=4,
        shuffle=False,
        return_segments=True,
    )
    batch = next(batches)
    # windows: [a b c E]d  [d e E f]g  [g h i j]E
    assert batch.segment_ids.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    boundaries = batch.input_ids == 0
    shifted = torch.cat([torch.zeros(3, 1, dtype=torch.long), boundaries[:, :-1].long().cumsum(1)], dim=1)
    assert torch.equal(batch.segment_ids, shifted)  # a new segment starts right after each EOS


def test_a_window_over_four_documents_numbers_them_0_to_3():
    """Segment ids count 0, 1, 2, ... per document a window touches, past the second one too."""
    tokenizer = CharTokenizer()
    batches = PackedBatches(
        docs("a", "b", "c", "defghijk"), tokenizer, 1, 8, shuffle=False, return_segments=True
    )
    batch = next(batches)
    assert batch.input_ids[0].tolist() == [97, 0, 98, 0, 99, 0, 100, 101]  # a E b E c E d e
    assert batch.segment_ids.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]]


def test_shuffle_is_seeded_per_epoch():
    texts = [chr(ord("a") + i) * 3 for i in range(12)]
    window_count = 12  # one epoch = 12 docs x 4 tokens = 48 tokens = 12 windows of 4

    def epochs(seed):
        batches = PackedBatches(docs(*texts), CharTokenizer(), batch_size=window_count, seq_len=4, seed=seed)
        return [[chr(row[0]) for row in next(batches).input_ids.tolist()] for _ in range(2)]

    first, second = epochs(0)
    assert sorted(first) == sorted(second) == sorted(t[0] for t in texts) and first != second
    assert epochs(0) == [first, second] and epochs(1) != [first, second]


def test_resume_gives_exactly_the_following_batches(corpus, tokenizer):
    def fresh():
        return PackedBatches(corpus.train, tokenizer, batch_size=4, seq_len=64, seed=7, return_segments=True)

    uninterrupted = fresh()
    expected = [next(uninterrupted) for _ in range(40)]  # several epochs of this small corpus
    interrupted = fresh()
    for _ in range(17):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = fresh()
    resumed.load_state_dict(state)
    for want in expected[17:]:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.segment_ids, want.segment_ids)
    assert resumed.state_dict()["epoch"] >= 1 and resumed.state_dict()["batches"] == 40
    ids = torch.cat([b.input_ids for b in expected])
    assert int(ids.max()) < tokenizer.vocab_size and (ids == tokenizer.eos_id).any()


def test_resume_with_another_batch_size_continues_the_stream():
    texts = docs(*(chr(ord("a") + i) * (i + 2) for i in range(9)))
    reference = PackedBatches(texts, CharTokenizer(), batch_size=2, seq_len=5, seed=3)
    rows = torch.cat([next(reference).input_ids for _ in range(6)])
    partial = PackedBatches(texts, CharTokenizer(), batch_size=2, seq_len=5, seed=3)
    next(partial)
    resumed = PackedBatches(texts, CharTokenizer(), batch_size=5, seq_len=5, seed=3)
    resumed.load_state_dict(partial.state_dict())
    assert torch.equal(next(resumed).input_ids, rows[2:7])
    with pytest.raises(K2LabError, match="the checkpoint's data stream has seq_len 5, this run's has 6;"):
        PackedBatches(texts, CharTokenizer(), batch_size=2, seq_len=6, seed=3).load_state_dict(
            partial.state_dict()
        )
    with pytest.raises(K2LabError, match="seed"):
        PackedBatches(texts, CharTokenizer(), batch_size=2, seq_len=5, seed=4).load_state_dict(
            partial.state_dict()
        )


def test_a_resume_mismatch_says_which_value_is_the_checkpoints():
    """It read "num_docs is 3, expected 2": backwards, the first value being the checkpoint's."""
    saved = PackedBatches(docs("ab", "cd", "ef"), CharTokenizer(), batch_size=1, seq_len=2).state_dict()
    with pytest.raises(K2LabError, match="the checkpoint's data stream has num_docs 3, this run's has 2;"):
        PackedBatches(docs("ab", "cd"), CharTokenizer(), batch_size=1, seq_len=2).load_state_dict(saved)


def test_a_state_past_its_document_is_refused_not_read_forever():
    """A tokenizer that changed under the same file (same vocabulary size) gave fewer tokens per document; the
    saved offset then lay past the document's end, and the next batch never came (an empty slice, forever)."""
    stream = PackedBatches(docs("abcdef", "gh"), CharTokenizer(), batch_size=1, seq_len=2)
    next(stream)
    state = stream.state_dict() | {"offset": 50}
    with pytest.raises(K2LabError, match="points at token 50 of document 0, which has 7 tokens now"):
        PackedBatches(docs("abcdef", "gh"), CharTokenizer(), batch_size=1, seq_len=2).load_state_dict(state)


def test_validation_batches_are_fixed_and_unshuffled():
    val = docs("abc", "de", "fghij")  # stream: a b c E d e E f g h i j E (13 tokens -> 3 windows of 4)
    batches = validation_batches(val, CharTokenizer(), batch_size=2, seq_len=4, return_segments=True)
    assert [tuple(b.input_ids.shape) for b in batches] == [(2, 4), (1, 4)]
    assert batches[0].input_ids[1].tolist() == [100, 101, 0, 102] and batches[1].labels[0].tolist() == [
        104,
        105,
        106,
        0,
    ]
    assert batches[0].segment_ids.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    again = validation_batches(val, CharTokenizer(), batch_size=2, seq_len=4)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again, strict=True))
    assert len(validation_batches(val, CharTokenizer(), batch_size=1, seq_len=4, max_batches=2)) == 2
    with pytest.raises(K2LabError, match="fewer than seq_len .* more or larger files .* shorter --seq-len"):
        validation_batches(val, CharTokenizer(), batch_size=2, seq_len=13)


def test_unigram_baseline_matches_hand_computation():
    tiny = Corpus("tiny", "", docs("aab"), docs("ab"), "0" * 64, 2, 5)
    # train ids a a b E: counts a=2, b=1, E=1, N=4; V=128; add-one: p(a)=3/132, p(b)=p(E)=2/132
    expected = -(math.log(3 / 132) + 2 * math.log(2 / 132)) / 3
    assert unigram_baseline(tiny, CharTokenizer()) == pytest.approx(expected, rel=1e-12)


def test_unigram_baseline_on_a_trained_tokenizer_is_below_uniform(corpus, tokenizer):
    baseline = unigram_baseline(corpus, tokenizer)
    assert 0 < baseline < math.log(tokenizer.vocab_size)


def test_a_lone_surrogate_is_a_clear_error(tokenizer):
    """JSON's unpaired "\\ud800" (an SFT file, a request) or undecodable argv bytes give a str that is no
    Unicode text: the backend refused it with a bare TypeError."""
    with pytest.raises(K2LabError, match=r"the text contains \\ud800 at character 1, a lone surrogate"):
        tokenizer.encode("a\ud800b")
    with pytest.raises(K2LabError, match=r"text 1 contains \\udcff"):
        tokenizer.encode_batch(["fine", "x\udcff"])
