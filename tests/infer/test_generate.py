import math

import pytest
import torch
from pydantic import ValidationError

from k2lab import build_model, load_preset
from k2lab.errors import K2LabError
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.cache import LatentCache
from k2lab.infer.generate import GenerationCache, prefill, sample_next, sampling_probs
from tests.conftest import KIMI_LINEAR_STYLE, nano_variant, randomize


def greedy_without_cache(model, prompt, steps):
    ids = torch.tensor([prompt])
    out = []
    for _ in range(steps):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return out


def test_greedy_matches_full_recompute(nano):
    prompt = [5, 17, 33, 2, 90]
    got = generate(nano, [prompt], GenerationConfig(max_new_tokens=12))[0]
    assert got == greedy_without_cache(nano, prompt, 12)


def test_prefill_runs_the_head_on_each_rows_last_position_only(nano, monkeypatch):
    import k2lab.models.decoder as decoder

    rows, plain = [], decoder.decode_linear
    monkeypatch.setattr(decoder, "decode_linear", lambda h, w: rows.append(h.shape[:-1]) or plain(h, w))
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    cache, logits = prefill(nano, prompts, 4)
    assert rows == [(2,)]  # not [2, 7]: the prompt's other logits are never needed
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(
            logits[row], nano(torch.tensor([prompt])).logits[0, -1], atol=1e-5, rtol=1e-5
        )


def test_batch_of_different_lengths_equals_each_alone(nano):
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [99]]
    config = GenerationConfig(max_new_tokens=10)
    batched = generate(nano, prompts, config)
    assert batched == [generate(nano, [p], config)[0] for p in prompts]


def test_stops_at_eos(nano):
    prompt = [5, 17, 33]
    first = generate(nano, [prompt], GenerationConfig(max_new_tokens=6))[0]
    stopped = generate(nano, [prompt], GenerationConfig(max_new_tokens=6, eos_token_id=first[2]))[0]
    assert stopped == first[: first.index(first[2]) + 1]


def test_sampling_is_seeded_and_top_p_limits_support():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]]).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens = sample_next(logits, GenerationConfig(temperature=1.0, top_p=0.8), generator)
    # p = softmax -> [0.71, 0.26, 0.013, 0.005]: the nucleus at 0.8 is {0, 1}
    assert set(tokens.tolist()) == {0, 1}
    full = sample_next(logits, GenerationConfig(temperature=1.0), torch.Generator().manual_seed(0))
    assert set(full.tolist()) >= {0, 1, 2}
    again = sample_next(
        logits, GenerationConfig(temperature=1.0, top_p=0.8), torch.Generator().manual_seed(0)
    )
    assert torch.equal(tokens, again)


def test_tiny_top_p_is_greedy(nano):
    prompt = [1, 2, 3, 4]
    greedy = generate(nano, [prompt], GenerationConfig(max_new_tokens=8))
    nucleus = generate(nano, [prompt], GenerationConfig(max_new_tokens=8, temperature=0.7, top_p=1e-6))
    assert greedy == nucleus


def test_empty_prompt_rejected(nano):
    with pytest.raises(ValueError, match="at least one token"):
        generate(nano, [[]])


@pytest.mark.parametrize(
    ("prompts", "eos", "message"),
    [
        ([[1, 500]], None, r"prompt 0: token id 500 is outside the model's vocabulary \[0, 128\)"),
        ([[1], [2, -1]], None, "prompt 1: token id -1 is outside"),
        ([[1, 2]], 128, "eos_token_id 128 is outside the model's vocabulary .*could never end"),
        ([[1, 2]], -1, "eos_token_id -1 is outside"),
    ],
)
def test_ids_outside_the_vocabulary_are_a_one_line_error(nano, prompts, eos, message):
    """An out-of-vocabulary or negative prompt id was a bare IndexError from the embedding, and an EOS id
    outside the vocabulary was accepted though it can never be sampled."""
    with pytest.raises(K2LabError, match=message):
        generate(nano, prompts, GenerationConfig(max_new_tokens=2, eos_token_id=eos))


def test_a_prompt_longer_than_the_context_is_refused():
    """A prompt past ``max_position_embeddings`` decoded on silently; new tokens may still pass it (a
    training run's closing sample and serve's background compile decode a fixed number of tokens)."""
    model = nano_variant(max_position_embeddings=16)
    with pytest.raises(K2LabError, match=r"prompt 1 has 17 tokens, more than the model's context of 16"):
        generate(model, [[1], list(range(1, 18))], GenerationConfig(max_new_tokens=1))
    assert len(generate(model, [list(range(1, 17))], GenerationConfig(max_new_tokens=3))[0]) == 3


@pytest.fixture(scope="module", params=["k2-nano", "k3-nano"])
def both(request):
    overrides = KIMI_LINEAR_STYLE if request.param == "k3-nano" else {}
    return randomize(build_model(load_preset(request.param, **overrides)), seed=2).eval()


def test_continued_cache_decodes_as_a_fresh_prefill(both):
    """Turn 2 extends turn 1's cache (only the new tokens prefill) and samples what a fresh call samples;
    row 0 stops at EOS early, so the cache must drop what was fed after it."""
    prompts = [[5, 17, 33, 2, 90], [7, 8, 9]]
    probe = generate(both, prompts, GenerationConfig(max_new_tokens=5))
    config = GenerationConfig(max_new_tokens=5, eos_token_id=probe[0][1])
    cache = GenerationCache()
    first = generate(both, prompts, config, cache=cache)
    assert len(first[0]) == 2 and cache.ids[0] == prompts[0] + first[0][:1]
    turn2 = [p + out + [40 + i, 41] for i, (p, out) in enumerate(zip(prompts, first, strict=True))]
    continued = generate(both, turn2, config, cache=cache)
    assert continued == generate(both, turn2, config)
    assert cache.ids == [p + out[:-1] for p, out in zip(turn2, continued, strict=True)]


def test_continuation_must_extend_the_cached_tokens(nano):
    cache = GenerationCache()
    (out,) = generate(nano, [[5, 6, 7]], GenerationConfig(max_new_tokens=2), cache=cache)
    with pytest.raises(ValueError, match="differs at token 1"):
        generate(nano, [[5, 9, 7, *out, 3]], cache=cache)
    with pytest.raises(ValueError, match="is not longer"):
        generate(nano, [[5, 6, 7]], cache=cache)
    with pytest.raises(ValueError, match="2 prompts continue a cache of 1"):
        generate(nano, [[5, 6, 7, *out], [1]], cache=cache)


def test_drop_finished_samples_the_same_tokens_and_keeps_each_rows_cache(both):
    """Rows that sample EOS leave the batch (``drop_finished``): the same tokens, greedy and with one
    sampling seed per row, and each row's cache holds what it held without dropping (a continuation)."""
    prompts = [[5, 17, 33, 2, 90], [7, 8, 9], [11, 12, 13, 14]]
    probe = generate(both, prompts, GenerationConfig(max_new_tokens=6))
    for temperature, seeds in ((0.0, None), (1.0, [3, 4, 5])):
        config = GenerationConfig(max_new_tokens=6, eos_token_id=probe[0][1], temperature=temperature)
        kept, dropped = GenerationCache(), GenerationCache()
        want = generate(both, prompts, config, row_seeds=seeds, cache=kept)
        config = config.model_copy(update={"drop_finished": True})
        assert generate(both, prompts, config, row_seeds=seeds, cache=dropped) == want
        assert dropped.ids == kept.ids
        for a, b in zip(dropped.rows, kept.rows, strict=True):
            torch.testing.assert_close(a.rows, b.rows)
    with pytest.raises(ValueError, match="needs row_seeds"):
        generate(both, prompts, config)


@pytest.fixture(scope="module")
def mini():
    return randomize(build_model(load_preset("k2-mini")), seed=3).eval()


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_tiers_keep_greedy_tokens_and_logits(mini, batch, monkeypatch):
    """k2-mini (the benchmark's model), 8 greedy tokens: the decode tiers (``decode_linear``) give the
    tokens of the plain path (every product as ``F.linear``), and each step's logits within fp32 rounding."""
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, mini.config.vocab_size, (batch, 8), generator=generator).tolist()
    config = GenerationConfig(max_new_tokens=8)
    calls = _LinearCalls()
    monkeypatch.setattr("k2lab.nn.decode_linear.F", calls)  # counts the products left to F.linear
    fast = generate(mini, prompts, config)
    fast_calls = calls.reset()
    prompt, tokens = torch.tensor(prompts), torch.tensor(fast)
    fast_logits = _teacher_forced_logits(mini, prompt, tokens)
    monkeypatch.setattr("k2lab.nn.decode_linear.MAX_ROWS", 0)  # every product through F.linear
    calls.reset()
    assert generate(mini, prompts, config) == fast
    assert calls.reset() > fast_calls  # the tier took products that the plain run leaves to F.linear
    for got, want in zip(fast_logits, _teacher_forced_logits(mini, prompt, tokens), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _LinearCalls:
    """``torch.nn.functional`` for ``k2lab.nn.decode_linear``, counting the calls that reach ``F.linear``."""

    def __init__(self) -> None:
        self.linear_calls = 0

    def reset(self) -> int:
        """The calls counted so far; the count starts again from zero."""
        calls, self.linear_calls = self.linear_calls, 0
        return calls

    def linear(self, *args, **kwargs):
        self.linear_calls += 1
        return torch.nn.functional.linear(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


def _teacher_forced_logits(model, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill prompt [B, P], then feed tokens [B, N] one decode step at a time; each step's logits [B, V]."""
    cache = LatentCache(model.config, prompt.shape[0], prompt.shape[1] + tokens.shape[1])
    with torch.inference_mode():
        model(prompt, cache=cache)
        return [model(tokens[:, i : i + 1], cache=cache).logits[:, -1] for i in range(tokens.shape[1])]


def test_per_row_generators_draw_what_multinomial_draws_row_by_row():
    """Row b of a batch with one generator per row samples exactly ``torch.multinomial`` of that row alone
    with that generator, step after step (masked tokens, top-p, sharp and flat rows)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * torch.tensor([0.1, 1.0, 3.0, 10.0, 1.0, 2.0])[:, None]
    logits[1, 100:] = float("-inf")  # an enforcer-style mask
    for config in (GenerationConfig(temperature=1.0), GenerationConfig(temperature=0.7, top_p=0.9)):
        batched = [torch.Generator().manual_seed(10 + b) for b in range(6)]
        alone = [torch.Generator().manual_seed(10 + b) for b in range(6)]
        for _ in range(50):
            got = sample_next(logits, config, batched)
            assert int(got[1]) < 100
            for b, g in enumerate(alone):
                probs = sampling_probs(logits[b : b + 1], config)
                assert int(got[b]) == int(torch.multinomial(probs, 1, generator=g))


def test_per_row_sampling_refuses_nan_like_multinomial():
    logits = torch.full((2, 5), float("-inf"))
    with pytest.raises(RuntimeError, match="inf, nan or element < 0"):
        sample_next(logits, GenerationConfig(temperature=1.0), [torch.Generator(), torch.Generator()])


def test_sampling_at_the_limits_of_fp32():
    """T = 1e-45 (logits / T overflows) samples the argmax, its limit; top_p = 1e-300 (0 in fp32) keeps the
    most likely token rather than nothing; both in the speculative path's per-row form too."""
    from k2lab.infer.speculative import processed_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.999], [-3.0, -2.0, -2.5, float("-inf")]])
    best = torch.tensor([1, 1])
    for temperature, top_p in ((1e-45, 1.0), (1.0, 1e-300)):
        probs = sampling_probs(logits, GenerationConfig(temperature=temperature, top_p=top_p))
        assert torch.isfinite(probs).all() and torch.equal(probs.argmax(-1), best)
        assert torch.equal((probs > 0).sum(-1), torch.tensor([1, 1]))
        per_row = processed_probs(logits, torch.tensor([temperature] * 2), torch.tensor([top_p] * 2))
        torch.testing.assert_close(per_row, torch.nn.functional.one_hot(best, 4).float())


@pytest.mark.parametrize("temperature", [1e-46, 5e-324])
def test_a_temperature_below_fp32s_smallest_samples_the_argmax(temperature):
    """A positive T that is 0 in fp32 made (z − max z) / T 0 / 0 at the maximum, NaN probabilities and a
    refused draw ("probability tensor contains inf/nan", HTTP 500 in the server): it samples the argmax, by
    one generator, one per row, and in the speculative path's per-row form."""
    from k2lab.infer.speculative import processed_probs

    logits = torch.tensor([[0.5, 2.0, -1.0, 1.999], [-3.0, -2.0, -2.5, float("-inf")]])
    best, config = torch.tensor([1, 1]), GenerationConfig(temperature=temperature)
    for generator in (torch.Generator().manual_seed(0), [torch.Generator(), torch.Generator()]):
        assert torch.equal(sample_next(logits, config, generator), best)
    one_hot = torch.nn.functional.one_hot(best, 4).float()
    torch.testing.assert_close(sampling_probs(logits, config), one_hot)
    torch.testing.assert_close(processed_probs(logits, torch.tensor([temperature] * 2), 1.0), one_hot)


@pytest.mark.parametrize("preset", ["k25-nano", "k3-vl-nano"])
def test_a_vision_language_model_never_samples_a_media_placeholder(preset):
    """Only a prompt's media can fill an image or video placeholder: sampled, the next step failed ("input_ids
    has 1 image placeholders but no image pixels"; the end-of-run sample of a k3-vl-nano training crashed so).
    With the placeholders made the most likely tokens, greedy and sampled text decoding skip them."""
    from k2lab.presets.vision_language import load_vlm_preset
    from k2lab.vision.vlm import build_vlm

    model = build_vlm(load_vlm_preset(preset)).eval()
    config = model.config
    with torch.no_grad():
        for token in (config.image_token_id, config.video_token_id):
            if token < model.language_model.config.vocab_size:
                model.language_model.lm_head.weight[token] *= 50.0
    for temperature in (0.0, 1.0):
        out = generate(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=12, temperature=temperature))
        assert len(out[0]) == 12 and not {config.image_token_id, config.video_token_id} & set(out[0])


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_sampling_numbers_are_finite(field, value):
    """A temperature of inf was accepted and sampled uniformly."""
    with pytest.raises(ValidationError, match="finite number"):
        GenerationConfig(**{field: value})


def test_each_row_samples_with_its_own_seed(nano):
    """``row_seeds``: row b's first token is ``torch.multinomial`` of softmax(logits / T) of a full forward
    with a generator seeded ``row_seeds[b]`` (the seeds 3, 5, 6 draw three different tokens here; one
    generator for every row, or ``config.seed`` for each, draws others)."""
    prompt, seeds = [5, 9, 2, 7], [3, 5, 6]
    expected = seeded_first_tokens(nano, prompt, seeds, 0.9)
    config = GenerationConfig(max_new_tokens=1, temperature=0.9)
    assert generate(nano, [prompt] * 3, config, row_seeds=seeds) == expected


def seeded_first_tokens(model, prompt, seeds, temperature):
    """Per seed, the first token ``torch.multinomial`` draws from softmax(logits / T) (fp64, then fp32) of
    a full forward of ``prompt``, with a generator seeded so; checks the seeds draw different tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    probs = torch.softmax(logits / temperature, dim=-1).float()
    tokens = [[int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(s)))] for s in seeds]
    assert len({tuple(t) for t in tokens}) == len(seeds)
    return tokens
