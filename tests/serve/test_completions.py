"""`/v1/completions`, `/tokenize`, `/detokenize` of `k2lab serve` through the official `openai` client: prompt
log-probs equal to a direct forward's log_softmax, greedy text equal to `generate`, token-id and batched
prompts, stop strings, streaming equal to non-streaming, and 400s with a message for bad requests."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.runtime.chat import render_chat
from k2lab.serve import Engine
from k2lab.serve.server import build_app
from tests.conftest import randomize, serving

openai = pytest.importorskip("openai")

KEY = "sk-test"
TEXT = "hello there, how are you? get_weather for Paris"


@pytest.fixture(scope="module")
def model():
    return randomize(build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=512)), seed=1)


@pytest.fixture(scope="module")
def engine(model):
    engine = Engine(model, max_batch=8, prefix_cache_bytes=1 << 22, block_size=8).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(small_tokenizer, engine):
    with serving(build_app(engine, small_tokenizer, "nano", api_key=KEY)) as base:
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def direct_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(t_i | t_<i) for i = 1 … T-1 from one forward of k2lab's model over all of ``ids``."""
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def complete(client, prompt, **kwargs):
    kwargs.setdefault("temperature", 0)
    extra = {k: kwargs.pop(k) for k in ("ignore_eos", "include_stop_str_in_output") if k in kwargs}
    return client.completions.create(model="nano", prompt=prompt, extra_body=extra or None, **kwargs)


def test_echo_scoring_equals_the_direct_forward(client, model, small_tokenizer):
    ids = small_tokenizer.encode(TEXT)
    out = complete(client, TEXT, max_tokens=0, echo=True, logprobs=3)
    choice = out.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens == [small_tokenizer.decode([t]) for t in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    expected = direct_logprobs(model, ids)
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(float(logp[i - 1].max()), abs=1e-5)


def test_greedy_completion_equals_generate_for_text_and_token_prompts(client, model, small_tokenizer):
    ids = small_tokenizer.encode(TEXT)
    new = generate(model, [ids], GenerationConfig(max_new_tokens=10, temperature=0))[0]
    expected = small_tokenizer.decode(new, skip_special_tokens=True)
    by_text = complete(client, TEXT, max_tokens=10, ignore_eos=True, logprobs=1)
    by_ids = complete(client, ids, max_tokens=10, ignore_eos=True)
    assert by_text.choices[0].text == expected == by_ids.choices[0].text
    assert by_text.choices[0].finish_reason == "length" and by_text.usage.completion_tokens == 10
    # not echoed: log-probs of the 10 sampled tokens only, each the greedy one
    lp = by_text.choices[0].logprobs
    got = torch.tensor(lp.token_logprobs)
    assert torch.allclose(got, direct_logprobs(model, ids + new)[-10:], atol=1e-5, rtol=0)
    assert all(
        value == max(top.values()) for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )
    echoed = complete(client, ids, max_tokens=10, ignore_eos=True, echo=True)
    assert echoed.choices[0].text == small_tokenizer.decode(ids) + expected


def test_batched_prompts_and_n(client, small_tokenizer):
    texts = [TEXT, "how are you", '{"city": "Paris"}']
    alone = [complete(client, t, max_tokens=6, ignore_eos=True).choices[0].text for t in texts]
    batch = complete(client, texts, max_tokens=6, ignore_eos=True)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    ids = [small_tokenizer.encode(t) for t in texts]
    assert [c.text for c in complete(client, ids, max_tokens=6, ignore_eos=True).choices] == alone
    assert batch.usage.prompt_tokens == sum(map(len, ids)) and batch.usage.completion_tokens == 18
    two = complete(client, texts[:2], max_tokens=6, ignore_eos=True, n=2)
    assert [c.text for c in two.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert two.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    sampled = [
        complete(client, texts[0], max_tokens=8, temperature=1.0, seed=7).choices[0].text for _ in "ab"
    ]
    assert sampled[0] == sampled[1]  # seeded sampling repeats


def test_stop_strings_cut_the_text(client):
    full = complete(client, TEXT, max_tokens=20, ignore_eos=True).choices[0].text
    assert len(full) >= 8, full
    stop = full[4:6]
    cut = full[: full.find(stop)]
    out = complete(client, TEXT, max_tokens=20, ignore_eos=True, stop=[stop, "never-there"])
    choice = out.choices[0]
    assert choice.text == cut and choice.finish_reason == "stop" and choice.stop_reason == stop
    assert out.usage.completion_tokens < 20
    kept = complete(client, TEXT, max_tokens=20, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.choices[0].text == cut + stop


def test_the_earliest_stop_string_cuts_the_text(client):
    """Two stop strings that complete on the same token (``ab`` and its last character ``b``, which the
    text has not held before): the text is cut before the one that begins first (OpenAI, vLLM)."""
    full = complete(client, TEXT, max_tokens=20, ignore_eos=True).choices[0].text
    i = next(i for i in range(len(full) - 1) if full[i + 1] not in full[: i + 1] and full[i + 1].strip())
    first, inner = full[i : i + 2], full[i + 1]
    assert full.find(first) == i and full.find(inner) == i + 1
    out = complete(client, TEXT, max_tokens=20, ignore_eos=True, stop=[inner, first]).choices[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (full[:i], "stop", first)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=12),
        dict(max_tokens=12, echo=True, logprobs=2),
        dict(max_tokens=0, echo=True, logprobs=1),
        dict(max_tokens=12, stop=["e", "o"], echo=True),
    ],
)
def test_streaming_equals_non_streaming(client, kwargs):
    prompts = [TEXT, "how are you"]
    whole = complete(client, prompts, ignore_eos=True, **kwargs)
    chunks = list(complete(client, prompts, ignore_eos=True, stream=True,
                           stream_options={"include_usage": True}, **kwargs))  # fmt: skip
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump() and not chunks[-1].choices
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine][-1] == choice.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
        if choice.logprobs is not None:
            streamed = [c.logprobs for c in mine if c.logprobs is not None]
            for field in ("tokens", "token_logprobs", "top_logprobs"):
                assert sum((getattr(s, field) for s in streamed), []) == getattr(choice.logprobs, field)


def test_tokenize_and_detokenize(server, small_tokenizer):
    ids = small_tokenizer.encode(TEXT)
    out = httpx.post(server + "/tokenize", json={"model": "nano", "prompt": TEXT}).json()
    assert out == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    messages = [{"role": "user", "content": "hello"}]
    chat = httpx.post(server + "/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == small_tokenizer.encode(render_chat(messages))
    assert len(chat["token_strs"]) == chat["count"]
    back = httpx.post(server + "/detokenize", json={"model": "nano", "tokens": ids}).json()
    assert back == {"prompt": TEXT}
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == "<|eos|>" and info["model_max_length"] == 512
    bad = httpx.post(server + "/detokenize", json={"tokens": [1, 300]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    both = httpx.post(server + "/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "nano"}, 400, "prompt"),
        ({"model": "nano", "prompt": []}, 400, "list of token ids"),
        ({"model": "nano", "prompt": [1, "a"]}, 400, "list of token ids"),
        ({"model": "nano", "prompt": [[1, 2], []]}, 400, "list of token ids"),
        ({"model": "nano", "prompt": [5, 300]}, 400, "token id 300 is outside the vocabulary"),
        ({"model": "nano", "prompt": "hi", "max_tokens": 0}, 400, "echo"),
        ({"model": "nano", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ({"model": "nano", "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": "nano", "prompt": "hi", "temperature": "0"}, 400, "temperature"),
        ({"model": "nano", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": "nano", "prompt": "hi", "echo": "yes"}, 400, "echo"),
        ({"model": "nano", "prompt": "hi", "stream": 1}, 400, "stream"),
        ({"model": "nano", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream"),
        ({"model": "nano", "prompt": "hi " * 400, "max_tokens": 400}, 400, "maximum context length"),
        ({"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ],
)
def test_bad_requests_get_a_message(server, body, status, needle):
    response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_malformed_json_and_missing_key(server):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    response = httpx.post(server + "/v1/completions", content=b"{not json", headers=headers)
    assert response.status_code == 400 and response.json()["error"]["message"]
    assert httpx.post(server + "/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_a_client_that_leaves_a_non_streaming_completion_frees_its_rows(server, engine):
    """Was: its n rows generated to max_tokens for nobody (chat cancelled; completions had no watcher)."""
    body = {"model": "nano", "prompt": "go", "n": 4, "max_tokens": 480, "temperature": 1.0, "seed": 4,
            "ignore_eos": True}  # fmt: skip
    cancelled = engine.finished.get("cancelled", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10.0, read=0.05))  # fmt: skip
    deadline = time.time() + 10
    while engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert engine.active == 0
    assert engine.finished.get("cancelled", 0) == cancelled + 4  # freed, not run to their 480 tokens


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"suffix": "end"}, "suffix"),
    ],
)
def test_fields_k2lab_cannot_honour_are_refused_not_ignored(server, extra, field):
    """Was: 200 with the same text (best_of, logit_bias, penalties were silently ignored); their defaults pass."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "nano", "prompt": "hi", "max_tokens": 2, **extra}
    response = httpx.post(server + "/v1/completions", json=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"does not support {field}" in error["message"]
    defaults = {
        "best_of": 1,
        "logit_bias": {},
        "frequency_penalty": 0,
        "presence_penalty": None,
        "suffix": "",
    }
    ok = httpx.post(server + "/v1/completions", json={**body, **defaults}, headers=headers)
    assert ok.status_code == 200, ok.text


def test_chat_prompts_encode_only_the_formats_markup_as_special(small_tokenizer):
    """Chat prompts were encoded with every special token recognised: a served imported tokenizer's reserved
    token written in a message became that special id. Chat completions and /tokenize of messages now encode
    only the format's markup as special ids (ChatFormat.encode_text); a raw prompt keeps its special tokens."""
    from tests.runtime.test_chat import with_reserved_token

    extended = with_reserved_token(small_tokenizer)
    reserved = extended.special_tokens["<|reserved_token_7|>"]
    messages = [{"role": "user", "content": "a <|reserved_token_7|> b"}]
    model = build_model(load_preset("k2-nano", vocab_size=extended.vocab_size, max_position_embeddings=512))
    engine = Engine(model, max_batch=2).start()
    with serving(build_app(engine, extended, "nano")) as base:
        chat = httpx.post(base + "/tokenize", json={"messages": messages}).json()["tokens"]
        raw = httpx.post(base + "/tokenize", json={"prompt": "<|reserved_token_7|>"}).json()["tokens"]
        body = {"model": "nano", "messages": messages, "max_tokens": 1}
        reply = httpx.post(base + "/v1/chat/completions", json=body)
    engine.shutdown()
    assert reserved not in chat and chat == small_tokenizer.encode(render_chat(messages))
    assert raw == [reserved] and reply.status_code == 200, reply.text
