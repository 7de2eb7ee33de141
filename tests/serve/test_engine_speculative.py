"""Speculative decoding in the serving engine: greedy replies identical to the engine without a draft for
concurrent requests of different lengths admitted at different times (an MLA and a hybrid KDA target, with
and without the prefix cache), cancelled requests, constrained rows (greedy ones walked through their
constraint, sampled ones without drafts), sampled rows that decode plainly on a CPU unless asked to draft,
deterministic seeded sampling, per-row settings that keep the target's distribution, and the counters in
``/health``."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.draft import EagleDraft, ModelDraft
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.infer.speculative import DRAFT_TOKENS, RowSettings, SpeculativeStep
from k2lab.serve import Engine, Request, SamplingParams
from k2lab.serve.server import build_app
from tests.conftest import randomize, serving
from tests.infer.test_speculative import chi_square, chi_square_bound, exact_joint

SHARED = list(range(10, 26))  # 16 tokens: four prefix-cache blocks of 4
FIRST = [([7, 8, 9], 9), (SHARED + [5, 6], 12), ([99], 7)]  # (prompt, max_tokens): admitted at once
LATER = [(SHARED + [40, 41, 42], 10), (list(range(50, 61)), 8), (SHARED + [3], 11)]  # once FIRST runs


@pytest.fixture(scope="module")
def mla():
    return randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1)))


@pytest.fixture(scope="module")
def hybrid():
    return randomize(build_model(load_preset("k3-nano", num_nextn_predict_layers=1)))


def engine(model, draft=None, prefix=True, max_batch=4, sampled_drafts=None) -> Engine:
    cache = 1 << 22 if prefix else 0
    return Engine(
        model, max_batch, cache, 4, "off", draft=draft, draft_tokens=3, sampled_drafts=sampled_drafts
    ).start()


def serve(eng: Engine, waves, temperature=0.0, constrain=None, cancel_after=None, stop=(), keep=False):
    """Submit each wave of (prompt, max_tokens) once the first request of the previous wave has 2 tokens;
    returns the finished requests (``temperature``: a float, or a function of the request's index;
    ``constrain(i)``: request i's constraint; ``cancel_after``: request 0 cancels itself after that many
    tokens; ``stop``: stop token ids; ``keep``: leave the engine running)."""
    done, started = threading.Semaphore(0), threading.Event()
    requests, index = [], 0
    for wave in waves:
        started.clear()
        for prompt, budget in wave:
            heat = temperature(index) if callable(temperature) else temperature
            params = SamplingParams(budget, heat, top_p=0.9, seed=index, stop_token_ids=stop)

            def on_token(token, me=index):
                if len(requests[me].tokens) >= 2:
                    started.set()
                if me == 0 and cancel_after is not None and len(requests[me].tokens) >= cancel_after:
                    requests[me].cancel()

            constraint = constrain(index) if constrain else None
            request = Request(prompt, params, on_token, lambda _: done.release(), constraint=constraint)
            requests.append(request)
            eng.submit(request)
            index += 1
        started.wait(timeout=60)
    for _ in requests:
        done.acquire(timeout=120)
    if not keep:
        eng.shutdown()
    return requests


def replies(requests):
    return [(r.tokens, r.finish_reason) for r in requests]


@pytest.fixture(scope="module")
def plain_replies(request):
    """The engine without a draft, greedy, per (model fixture, prefix cache): computed once per module."""
    cache = {}

    def get(name: str, prefix: bool = True):
        if (name, prefix) not in cache:
            model = request.getfixturevalue(name)
            cache[name, prefix] = replies(serve(engine(model, prefix=prefix), [FIRST, LATER]))
        return cache[name, prefix]

    return get


@pytest.mark.parametrize(
    ("name", "draft", "prefix"),
    [("mla", "self", True), ("mla", "eagle", True), ("mla", "self", False), ("hybrid", "eagle", True)],
)
def test_greedy_replies_equal_the_plain_engine(request, plain_replies, name, draft, prefix):
    """Six greedy requests, three admitted after the first three are decoding (prefix-cache hits on the
    shared 16 tokens): the same tokens and finish reasons as without a draft."""
    model = request.getfixturevalue(name)
    drafter = ModelDraft(model) if draft == "self" else EagleDraft(model, model.mtp[0])
    spec_engine = engine(model, drafter, prefix=prefix)
    spec = serve(spec_engine, [FIRST, LATER])
    assert replies(spec) == plain_replies(name, prefix)
    stats = spec_engine.speculation.stats
    assert stats.steps > 0 and spec_engine.steps < sum(len(r.tokens) for r in spec)
    if draft == "self":  # the target drafting for itself: most drafts are accepted
        assert stats.mean_accepted > 1
    if prefix:
        assert spec_engine.prefix_cache.stats()["hits"] > 0


def test_cancelled_request_leaves_the_others_unchanged(mla, plain_replies):
    spec = serve(engine(mla, ModelDraft(mla)), [FIRST, LATER], cancel_after=3)
    assert spec[0].finish_reason == "cancelled" and len(spec[0].tokens) >= 3
    assert replies(spec[1:]) == plain_replies("mla")[1:]


def test_stop_inside_an_accepted_window_and_the_next_turn(mla, plain_replies):
    """A stop token met inside a window of accepted drafts (self-draft) ends the reply there; the retired
    rows go into the prefix cache cut to what was delivered, so each conversation's next turn (which hits
    it) replies as the plain engine's."""
    stop = (plain_replies("mla")[1][0][4],)
    sides = {}
    for side, draft in (("plain", None), ("speculative", ModelDraft(mla))):
        eng = engine(mla, draft)
        first = serve(eng, [FIRST, LATER], stop=stop, keep=True)
        turns = [(r.prompt + r.tokens + [stop[0], 5, 6], 6) for r in first]
        hits = eng.prefix_cache.stats()["hits"]
        sides[side] = replies(first) + replies(serve(eng, [turns], stop=stop))
        assert eng.prefix_cache.stats()["hits"] > hits
    assert sides["speculative"] == sides["plain"]
    assert ("stop" in {reason for _, reason in sides["plain"]}) and eng.speculation.stats.accepted > 0


class Banned:
    """A constraint: never the tokens ``banned``; records what it was told."""

    def __init__(self, banned):
        self.banned, self.seen = banned, []

    def mask(self, logits):
        logits[self.banned] = float("-inf")

    def advance(self, token):
        assert token not in self.banned
        self.seen.append(token)


def test_constrained_greedy_rows_draft_and_reply_as_the_plain_engine(mla, plain_replies):
    """Requests 0 and 3 carry a constraint banning what unconstrained greedy decoding picks, which is what the
    self-draft proposes: walked through their constraint (``Engine._walk``) they still draft, reply exactly
    as the plain engine, and their constraint is fed what plain decoding feeds it (no more: a stop token ends
    the walk, and nothing past it or past max_tokens is fed)."""
    banned = sorted({t for tokens, _ in plain_replies("mla") for t in tokens[:3]})
    stop = (plain_replies("mla")[1][0][4],)

    def constrain(i):
        return Banned(banned) if i in (0, 3) else None

    plain = serve(engine(mla), [FIRST, LATER], constrain=constrain, stop=stop)
    spec_engine = engine(mla, ModelDraft(mla))
    spec = serve(spec_engine, [FIRST, LATER], constrain=constrain, stop=stop)
    assert replies(spec) == replies(plain)
    assert [spec[i].constraint.seen for i in (0, 3)] == [plain[i].constraint.seen for i in (0, 3)]
    assert not set(spec[3].tokens) & set(banned)
    stats = spec_engine.speculation.stats
    assert stats.proposed == 3 * stats.row_steps and stats.accepted > 0


def test_a_batch_of_constrained_rows(mla):
    """Only constrained rows: greedy ones speculate (the self-draft's drafts held where the constraint lets
    them), sampled ones take no drafts (plain steps) even with sampled drafts on; both reply as the plain
    engine."""
    waves = [[(p, n) for p, n in FIRST]]
    plain = serve(engine(mla), waves, constrain=lambda i: Banned([5]))
    spec_engine = engine(mla, ModelDraft(mla))
    assert replies(serve(spec_engine, waves, constrain=lambda i: Banned([5]))) == replies(plain)
    assert spec_engine.speculation.stats.steps > 0 and spec_engine.speculation.stats.accepted > 0
    sampled = serve(engine(mla), waves, temperature=1.0, constrain=lambda i: Banned([5]))
    spec_engine = engine(mla, EagleDraft(mla, mla.mtp[0]), sampled_drafts=True)
    spec = serve(spec_engine, waves, temperature=1.0, constrain=lambda i: Banned([5]))
    assert replies(spec) == replies(sampled)
    assert spec_engine.speculation.stats.steps == 0


def test_seeded_sampled_replies_are_deterministic(mla, plain_replies):
    """Temperature 1, top-p 0.9, a seed per request, sampled rows drafting: two runs give the same replies
    (not the greedy ones)."""
    spec_engine = engine(mla, ModelDraft(mla), sampled_drafts=True)
    first = serve(spec_engine, [FIRST, LATER], temperature=1.0)
    again = serve(engine(mla, ModelDraft(mla), sampled_drafts=True), [FIRST, LATER], temperature=1.0)
    assert replies(first) == replies(again) != plain_replies("mla")
    stats = spec_engine.speculation.stats
    assert stats.steps > 0 and stats.accepted == stats.proposed  # q = p (self-draft): u·q < p always


def test_sampled_rows_decode_plainly_on_a_cpu_by_default(mla):
    """On a CPU a sampled request takes no drafts unless asked (``speculation_decision`` for sampled decoding):
    a batch of sampled requests runs plain decode steps, replying as the engine without a draft; greedy
    requests admitted beside them draft and reply as plain greedy decoding; sampled rows keep their replies."""
    spec_engine = engine(mla, EagleDraft(mla, mla.mtp[0]))
    assert spec_engine.speculation.sampled_drafts is False
    assert "sampled speculative decoding on CPU" in spec_engine.speculation.sampled_reason
    sampled = serve(spec_engine, [FIRST, LATER], temperature=1.0)
    assert replies(sampled) == replies(serve(engine(mla), [FIRST, LATER], temperature=1.0))
    assert spec_engine.speculation.stats.steps == 0

    def mixed(i):
        return 1.0 if i < len(FIRST) else 0.0  # the first wave sampled, the later one greedy

    mixed_engine = engine(mla, ModelDraft(mla))  # the model drafting for itself: greedy drafts all hold
    spec = serve(mixed_engine, [FIRST, LATER], temperature=mixed)
    assert replies(spec) == replies(serve(engine(mla), [FIRST, LATER], temperature=mixed))
    stats = mixed_engine.speculation.stats
    assert stats.steps > 0 and stats.accepted > 0  # the greedy rows drafted


def test_row_settings_keep_the_target_distribution():
    """One batch mixing sampled rows (T = 0.8, top-p 0.9, a generator each), greedy rows and plain rows
    (no drafts; here their token is the argmax): the sampled rows' first three tokens pass the chi-square
    bound against the exact joint (vocabulary 8); greedy and plain rows give plain greedy decoding."""
    target = randomize(build_model(load_preset("k2-nano", vocab_size=8)))
    small = randomize(build_model(load_preset("k2-nano", vocab_size=8, num_hidden_layers=1)), seed=5)
    prompt, kinds = [3, 5, 1, 6], ["sampled", "greedy", "plain"] * 1500
    settings = RowSettings(
        temperature=torch.tensor([0.8 if kind == "sampled" else 0.0 for kind in kinds]),
        top_p=torch.tensor([0.9] * len(kinds)),
        generators=[torch.Generator().manual_seed(i) for i in range(len(kinds))],
        plain=torch.tensor([kind == "plain" for kind in kinds]),
    )
    runner = SpeculativeStep(target, ModelDraft(small), GenerationConfig(compile="off"), rows=settings)
    ids = torch.tensor([prompt] * len(kinds))
    outputs = [[t] for t in runner.prefill(ids, torch.ones_like(ids, dtype=torch.bool), 32).tolist()]
    plain_counts = []
    for _ in range(2):  # each step emits >= 1 token: >= 3 per row
        tokens, counts = runner.step(2, plain_token=lambda rows, logits: logits.argmax(-1))
        plain_counts += counts[settings.plain].tolist()
        for row, (new, count) in enumerate(zip(tokens.tolist(), counts.tolist(), strict=True)):
            outputs[row] += new[:count]
    greedy = generate(target, [prompt], GenerationConfig(max_new_tokens=3))[0]
    by_kind = {
        kind: [tuple(out[:3]) for out, k in zip(outputs, kinds, strict=True) if k == kind] for kind in kinds
    }
    assert set(by_kind["greedy"]) == set(by_kind["plain"]) == {tuple(greedy)} and set(plain_counts) == {1}
    stat, dof = chi_square(by_kind["sampled"], exact_joint(target, prompt, 3, 0.8, 0.9))
    assert dof > 10
    assert stat < chi_square_bound(dof), (stat, dof)


def test_health_reports_the_acceptance(small_tokenizer):
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300, num_nextn_predict_layers=1)))
    eng = engine(model, ModelDraft(model))
    serve_one = Request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
    finished = threading.Event()
    serve_one.on_finish = lambda _: finished.set()
    eng.submit(serve_one)
    assert finished.wait(60)
    with serving(build_app(eng, small_tokenizer, "nano")) as base:
        health = httpx.get(base + "/health").json()["speculative"]
    eng.shutdown()
    assert health["draft_tokens"] == 3 and health["verify_steps"] > 0 and health["mean_accepted"] > 0
    assert health["sampled_drafts"] is False  # a CPU: sampled requests decode plainly
    assert health["tokens_per_step"] == pytest.approx(1 + health["mean_accepted"], abs=1e-3)


def test_greedy_chats_draft_and_reply_as_the_plain_server(small_tokenizer):
    """Every chat carries the tool-call constraint (without tools it still bans opening a section): greedy
    chats without tools, with tool_choice "none" and with tools "auto" draft on a server with a draft
    (``verify_steps`` grows) and reply as the server without one, token for token."""
    from tests.serve.test_server import WEATHER

    model = randomize(build_model(load_preset("k2-nano", vocab_size=300, num_nextn_predict_layers=1)))
    bodies = [
        {"messages": [{"role": "user", "content": f"hello there {i}, how are you?"}], **extra}
        for i, extra in enumerate([{}, {"tools": [WEATHER], "tool_choice": "none"}, {"tools": [WEATHER]}])
    ]
    answers = {}
    for side, draft in (("plain", None), ("speculative", ModelDraft(model))):
        eng = engine(model, draft)
        with serving(build_app(eng, small_tokenizer, "nano")) as base:
            answers[side] = [
                httpx.post(base + "/v1/chat/completions", json={"model": "nano", "max_tokens": 12,
                                                                "temperature": 0, **body}, timeout=60).json()
                for body in bodies
            ]  # fmt: skip
            health = httpx.get(base + "/health").json()["speculative"]
        eng.shutdown()
    assert [a["choices"] for a in answers["speculative"]] == [a["choices"] for a in answers["plain"]]
    assert [a["usage"] for a in answers["speculative"]] == [a["usage"] for a in answers["plain"]]
    assert health["verify_steps"] > 0 and health["mean_accepted"] > 0


def test_serve_command_speculates_when_the_model_has_a_draft(tmp_path, small_tokenizer, monkeypatch, capsys):
    """`k2lab serve` with an MTP layer: eager (--compile off), speculative with k = DRAFT_TOKENS for greedy
    requests only on a CPU (said), --draft-tokens k, --no-speculative; with the decode step compiled on CPU
    (--compile on, or by default once built in the background) off unless asked for (and said; --speculative
    then drafts for sampled requests too); without a draft, --speculative is a clear error."""
    from k2lab.cli import main
    from k2lab.model_dir import save_model

    seen, engines = [], []

    threads = torch.get_num_threads()

    def run(app, sock):
        engines.append(app.state.k2lab.engine)
        seen.append(engines[-1].speculation)
        # the main thread runs torch single-threaded, the engine's thread takes the threads (serve.threads)
        assert torch.get_num_threads() == 1 and engines[-1].threads == threads
        torch.set_num_threads(threads)  # this test's process goes on with its own setting

    monkeypatch.setattr("k2lab.serve.listen.serve_on", run)
    monkeypatch.setattr("k2lab.serve.background_compile.BackgroundCompile.start", lambda self: self)
    for name, layers in (("mtp", 1), ("plain", 0)):
        model = build_model(load_preset("k2-nano", vocab_size=300, num_nextn_predict_layers=layers))
        save_model(model, tmp_path / name)
        small_tokenizer.save(str(tmp_path / name / "tokenizer.json"))
    compiled = ["--compile", "on"]  # the step is built at its first call, which never comes here
    eager = ["--compile", "off"]
    runs = ([*eager], [*eager, "--draft-tokens", "2"], ["--no-speculative"], compiled,
            [*compiled, "--speculative"], [])  # fmt: skip
    for flags in runs:
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "-c", str(tmp_path / "mtp"), "--port", "0", *flags])
        assert exit_info.value.code == 0
    assert [s and s.k for s in seen] == [DRAFT_TOKENS, 2, None, None, DRAFT_TOKENS, None]
    assert [s and s.sampled_drafts for s in seen] == [False, False, None, None, True, None]  # --speculative
    # the default on a CPU: eager until the step is built in the background (start stubbed here), no draft
    assert [e.background is not None for e in engines] == [False, False, True, False, False, True]
    printed = capsys.readouterr().out
    assert "sampled requests (temperature > 0) decode plainly: sampled speculative decoding on CPU" in printed
    assert "decode step: eager until the compiled step is built in the background" in printed
    assert "speculative decoding off: compiled decoding on CPU is faster" in printed
    assert "decode weights: " in printed  # the compiled step's choice and its reason
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "-c", str(tmp_path / "plain"), "--port", "0", "--speculative"])
    assert exit_info.value.code == 2 and len(seen) == 6
