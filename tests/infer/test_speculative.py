"""Speculative decoding: greedy output identical to plain ``generate`` (MLA and hybrid KDA targets, a small
causal LM or the EAGLE/MTP draft), the sampled distribution equal to the target's (chi-square against the
exact distribution by enumeration), batching, EOS, max_new_tokens, cache rollback and compaction."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.errors import K2LabError
from k2lab.infer import GenerationConfig, LatentCache, generate
from k2lab.infer.draft import EagleDraft, ModelDraft
from k2lab.infer.rollback import CacheWindow, compact
from k2lab.infer.speculative import processed_probs, speculation_decision, speculative_generate
from tests.conftest import KIMI_LINEAR_STYLE, randomize
from tests.infer.test_decode_weights import rounded
from tests.infer.test_generate import seeded_first_tokens

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [99]]


def k2(**overrides):
    return randomize(build_model(load_preset("k2-nano", **overrides)))


def k3(**overrides):
    return randomize(build_model(load_preset("k3-nano", **overrides)))


TARGETS = {
    "k2": lambda: k2(num_nextn_predict_layers=1),
    "k3": lambda: k3(num_nextn_predict_layers=1),
    "kimi-linear": lambda: k3(num_nextn_predict_layers=1, **KIMI_LINEAR_STYLE),
}


@pytest.fixture(params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


def drafts(target):
    """A weak independent draft, the target itself (everything accepted) and the EAGLE draft."""
    small = randomize(build_model(load_preset("k2-nano", num_hidden_layers=1)), seed=1)
    return {
        "small": ModelDraft(small),
        "self": ModelDraft(target),
        "eagle": EagleDraft(target, target.mtp[0]),
    }


def test_greedy_equals_plain_decoding(target, k=3):
    config = GenerationConfig(max_new_tokens=11)
    plain = generate(target, PROMPTS, config)
    for name, draft in drafts(target).items():
        out, stats = speculative_generate(target, draft, PROMPTS, config, num_draft_tokens=k)
        assert out == plain, name
        assert all(len(row) == 11 for row in out)
        if name == "self":  # every drafted token is accepted
            assert stats.accepted == stats.proposed and stats.tokens_per_step > 1 + 0.6 * k


def perturbed(model, std=0.03, seed=7):
    """A copy of ``model`` with noise on every weight: a draft that agrees with it only some of the time."""
    twin = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(std * torch.randn(param.shape, generator=generator))
    return twin


@pytest.mark.parametrize("name", ["k2", "k3"])
def test_rows_accept_different_counts(name):
    """A near-copy draft: rows accept different numbers of tokens per step, the output is still plain."""
    target = TARGETS[name]()
    config = GenerationConfig(max_new_tokens=10)
    draft = ModelDraft(perturbed(target))
    out, stats = speculative_generate(target, draft, PROMPTS * 2, config, num_draft_tokens=4)
    assert out == generate(target, PROMPTS * 2, config)
    assert 0 < stats.accepted < stats.proposed


def test_eos_inside_an_accepted_window():
    """Everything is accepted (self-draft), and row 1 meets EOS in the middle of a window."""
    target = k2()
    plain = generate(target, PROMPTS, GenerationConfig(max_new_tokens=9))
    eos = plain[1][3]
    stopped = GenerationConfig(max_new_tokens=9, eos_token_id=eos)
    out, _ = speculative_generate(target, ModelDraft(target), PROMPTS, stopped, num_draft_tokens=4)
    assert out == generate(target, PROMPTS, stopped)
    assert out[1] == plain[1][: plain[1].index(eos) + 1]


@pytest.mark.parametrize("budget", [1, 2, 5, 6])
def test_max_new_tokens_exact(budget):
    target = k2()
    config = GenerationConfig(max_new_tokens=budget, temperature=1.0)
    out, _ = speculative_generate(target, ModelDraft(target), PROMPTS, config, num_draft_tokens=4)
    assert [len(row) for row in out] == [budget] * len(PROMPTS)


@pytest.mark.parametrize(("budget", "eos_at"), [(12, None), (7, None), (12, 5), (9, 2)])
def test_stats_count_the_tokens_emitted(budget, eos_at):
    """Tokens verified but cut at ``max_new_tokens`` or after EOS are not counted: 12 tokens of a self-draft
    at k = 4 are the prefill's and 11 from 3 verify forwards (3.67 per forward, not the 4.00 reported)."""
    target = k2()
    plain = generate(target, PROMPTS, GenerationConfig(max_new_tokens=budget))
    eos = None if eos_at is None else plain[1][eos_at]
    config = GenerationConfig(max_new_tokens=budget, eos_token_id=eos)
    out, stats = speculative_generate(target, ModelDraft(target), PROMPTS, config, num_draft_tokens=4)
    assert out == generate(target, PROMPTS, config)
    emitted = sum(len(row) - 1 for row in out)  # all but each row's first token (the prefill's)
    assert stats.accepted + stats.row_steps == emitted
    assert stats.tokens_per_step == emitted / stats.row_steps
    if (budget, eos_at) == (12, None):
        single, alone = speculative_generate(target, ModelDraft(target), [[1, 2, 3]], config)
        assert (len(single[0]), alone.steps, alone.accepted) == (12, 3, 8)
        assert alone.tokens_per_step == pytest.approx(11 / 3)


def test_a_draft_that_does_not_fit_the_target_is_refused():
    """A draft of another vocabulary (an IndexError in the embedding, or silently proposing ids the target
    lacks) and an EAGLE module of another model (an AttributeError in the rotary tables) are one-line
    errors where the draft meets its target."""
    config = GenerationConfig(max_new_tokens=3)
    target, small = k2(num_nextn_predict_layers=1), k2(vocab_size=64)
    for model, draft, theirs, ours in ((target, small, 64, 128), (small, target, 128, 64)):
        message = f"the draft model's vocabulary has {theirs} tokens, the target's {ours}"
        with pytest.raises(K2LabError, match=message):
            speculative_generate(model, ModelDraft(draft), [[1, 2, 3]], config)
    hybrid = k3(num_nextn_predict_layers=1)
    with pytest.raises(K2LabError, match="MTP module does not fit the target: the target's MTP block has"):
        speculative_generate(hybrid, EagleDraft(hybrid, target.mtp[0]), [[1, 2, 3]], config)
    nope = k2(num_nextn_predict_layers=1, mla_rope=False)  # the same shapes, no rotary tables
    with pytest.raises(K2LabError, match="attention is rotary: True, the target's \\(mla_rope\\): False"):
        speculative_generate(nope, EagleDraft(nope, target.mtp[0]), [[1, 2, 3]], config)
    with pytest.raises(K2LabError, match="built on another model than the target: hidden_size 64 != 32"):
        speculative_generate(k2(hidden_size=32, q_lora_rank=16), EagleDraft(target, target.mtp[0]), [[1]])
    with pytest.raises(K2LabError, match="prompt 0: token id 128 is outside"):
        speculative_generate(target, ModelDraft(target), [[1, 128]], config)


def test_constraint_falls_back_to_plain_decoding():
    class Ban:
        def mask(self, logits):
            logits[5] = float("-inf")

        def advance(self, token):
            pass

    target = k2()
    config = GenerationConfig(max_new_tokens=6)
    constraints = [Ban(), None, None]
    out, stats = speculative_generate(target, ModelDraft(target), PROMPTS, config, constraints=constraints)
    assert out == generate(target, PROMPTS, config, constraints=constraints) and stats.steps == 0


def test_rollback_keeps_the_first_tokens_of_a_window(target):
    """After a window of 4 tokens closed at keep = (1, 3), the next logits equal those of a cache that only
    ever saw the kept tokens (MLA holes + KDA per-token states), then again after compaction."""
    ids = torch.randint(3, 128, (2, 6))
    extra = torch.randint(3, 128, (2, 4))
    nxt = torch.randint(3, 128, (2, 1))
    keep = torch.tensor([1, 3])
    cache = LatentCache(target.config, 2, 32)
    target(ids, cache=cache)
    window = CacheWindow(cache)
    target(extra[:, :2], cache=cache)
    target(extra[:, 2:], cache=cache)
    window.close(keep)
    got = target(nxt, cache=cache).logits[:, -1]
    for row in range(2):
        alone = torch.cat([ids[row], extra[row, : keep[row]], nxt[row]])[None]
        assert torch.allclose(got[row], target(alone).logits[0, -1], atol=1e-4, rtol=1e-4)
    compact(cache)
    assert cache.length == 6 + 3 + 1 and not cache.key_valid[0, :1].any()
    again = target(nxt, cache=cache).logits[:, -1]
    for row in range(2):
        alone = torch.cat([ids[row], extra[row, : keep[row]], nxt[row], nxt[row]])[None]
        assert torch.allclose(again[row], target(alone).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_long_generation_compacts_the_cache():
    """A draft that is always wrong leaves k holes per token: the storage (prompt + budget + 2(k+1)) runs
    out and is compacted several times; the output still equals plain decoding."""
    target = k2()
    draft = ModelDraft(randomize(build_model(load_preset("k2-nano", num_hidden_layers=1)), seed=3))
    config = GenerationConfig(max_new_tokens=30)
    out, stats = speculative_generate(target, draft, PROMPTS[:2], config, num_draft_tokens=6)
    assert out == generate(target, PROMPTS[:2], config)
    assert stats.steps > 15


# ------------------------------------------------------------------------------------------- sampling


def exact_joint(model, prompt, length, temperature, top_p):
    """P(x_1 … x_length | prompt) for every sequence, by enumeration with full forwards: {tuple: p}."""
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, mass in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            probs = processed_probs(logits, temperature, top_p).double()
            for token in range(probs.shape[0]):
                if probs[token] > 0:
                    grown[seq + (token,)] = mass * float(probs[token])
        joint = grown
    return joint


def chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Upper 1e-6 quantile of χ²_dof by the Wilson–Hilferty approximation (z = 4.75)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(samples, joint):
    """Pearson's statistic over cells with expected count ≥ 5 (the rest pooled into one cell) and its dof."""
    n = len(samples)
    counts = {}
    for seq in samples:
        counts[seq] = counts.get(seq, 0) + 1
    assert set(counts) <= set(joint), "a sequence outside the target's support was sampled"
    big = [seq for seq, p in joint.items() if n * p >= 5]
    rest_expected = n * (1 - sum(joint[s] for s in big))
    stat = sum((counts.get(s, 0) - n * joint[s]) ** 2 / (n * joint[s]) for s in big)
    cells = len(big)
    if rest_expected >= 5:
        rest = n - sum(counts.get(s, 0) for s in big)
        stat += (rest - rest_expected) ** 2 / rest_expected
        cells += 1
    return stat, cells - 1


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_sampling_preserves_the_target_distribution(temperature, top_p):
    """The first 3 tokens (one plain draw, then one speculative step with k = 2: both draft positions and
    the bonus/residual draw) of 5,000 rows over two seeds, against the exact joint over a vocabulary of 8.
    Under the null the statistic is χ²_dof; the bound is its 1e-6 quantile, so a correct sampler fails
    once in a million runs while a biased one (e.g. no residual renormalisation) fails at this n."""
    target = k2(vocab_size=8)
    small = randomize(build_model(load_preset("k2-nano", vocab_size=8, num_hidden_layers=1)), seed=5)
    prompt = [3, 5, 1, 6]
    joint = exact_joint(target, prompt, 3, temperature, top_p)
    samples = []
    for seed in (0, 1):
        config = GenerationConfig(max_new_tokens=3, temperature=temperature, top_p=top_p, seed=seed)
        out, stats = speculative_generate(
            target, ModelDraft(small), [prompt] * 2500, config, num_draft_tokens=2
        )
        assert 0 < stats.accepted < stats.proposed  # both accepting and rejecting paths are exercised
        samples += [tuple(row) for row in out]
    stat, dof = chi_square(samples, joint)
    assert dof > 10
    assert stat < chi_square_bound(dof), (stat, dof)


def test_chi_square_detects_a_wrong_distribution():
    """The test above has power: samples from the draft alone (no rejection) fail the same bound."""
    target = k2(vocab_size=8)
    small = randomize(build_model(load_preset("k2-nano", vocab_size=8, num_hidden_layers=1)), seed=5)
    prompt = [3, 5, 1, 6]
    joint = exact_joint(target, prompt, 3, 1.0, 1.0)
    wrong = exact_joint(small, prompt, 3, 1.0, 1.0)
    sequences = list(wrong)
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor([wrong[s] for s in sequences]), 5000, True, generator=generator)
    stat, dof = chi_square([sequences[i] for i in draws.tolist()], joint)
    assert stat > chi_square_bound(dof)


def test_processed_probs_matches_nucleus_sampling():
    logits = torch.tensor([4.0, 3.0, 0.0, -1.0])
    probs = processed_probs(logits, 1.0, 0.8)
    full = logits.softmax(-1)
    assert torch.allclose(probs, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))


def recording(draft, seen: list[torch.Tensor]):
    """``draft`` with each ``propose`` call's logits [B, k, V] appended to ``seen``."""
    propose = draft.propose

    def record(k, pick):
        tokens, logits = propose(k, pick)
        seen.append(logits)
        return tokens, logits

    draft.propose = record
    return draft


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_compiled_eagle_draft_proposes_as_eager(weights, monkeypatch):
    """``compile="on"``: the verify and the EAGLE draft's proposing forwards run compiled (one ``EagleForward``
    graph per forward kind: a proposal's one entry, an accepted window), their matrices read as ``weights``
    (bf16: the target's and the block's twins; the model's matrices are bf16-rounded, so both read the same
    values); greedy output equals plain decoding, and every proposal's logits equal the eager draft's within
    fp32 rounding, step for step. Two rows and k = 2 keep every forward within the reduction tiers (≤ 6
    rows), so the build stays short."""
    monkeypatch.setattr("k2lab.infer.compiled.CPP_WRAPPER_DEVICES", ())  # guards only: the quicker build
    model, prompts = rounded(k2(num_nextn_predict_layers=1)).eval(), PROMPTS[:2]
    runs = {}
    for compile in ("off", "on"):
        seen: list[torch.Tensor] = []
        config = GenerationConfig(max_new_tokens=11, compile=compile, decode_weights=weights)
        draft = recording(EagleDraft(model, model.mtp[0]), seen)
        runs[compile] = *speculative_generate(model, draft, prompts, config, num_draft_tokens=2), seen
    eager_out, eager_stats, eager_logits = runs["off"]
    out, stats, logits = runs["on"]
    assert out == eager_out == generate(model, prompts, GenerationConfig(max_new_tokens=11))
    assert stats == eager_stats and len(logits) == stats.steps
    for got, want in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_speculation_decision():
    """As requested; by default on, except on a CPU where the decode step runs compiled or decoding samples."""
    assert speculation_decision(None, "auto", "cpu")[0] and speculation_decision(None, "off", "cpu")[0]
    assert speculation_decision(None, "on", "cuda")[0] and speculation_decision(None, "auto", "cuda")[0]
    assert speculation_decision(None, "on", "cpu") == (
        False,
        "compiled decoding on CPU is faster than speculative decoding (--speculative to force it)",
    )
    assert speculation_decision(True, "on", "cpu") == (True, "requested")
    sampled = speculation_decision(None, "off", "cpu", sampled=True)
    assert not sampled[0] and sampled[1].startswith("sampled speculative decoding on CPU measured")
    assert speculation_decision(None, "auto", "cuda", sampled=True)[0]
    assert speculation_decision(True, "off", "cpu", sampled=True) == (True, "requested")
    assert speculation_decision(False, "off", "cuda") == (False, "requested")


def test_each_row_samples_with_its_own_seed():
    """``row_seeds``: row b's first token is ``torch.multinomial`` of softmax(logits / T) of a full forward
    with a generator seeded ``row_seeds[b]`` (the seeds 3, 5, 6 draw three different tokens here)."""
    target = k2()
    prompt, seeds = [5, 9, 2, 7], [3, 5, 6]
    expected = seeded_first_tokens(target, prompt, seeds, 0.9)
    config = GenerationConfig(max_new_tokens=1, temperature=0.9)
    out, _ = speculative_generate(
        target, ModelDraft(target), [prompt] * 3, config, num_draft_tokens=2, row_seeds=seeds
    )
    assert out == expected
