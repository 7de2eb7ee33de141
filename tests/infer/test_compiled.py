"""The compiled decode step equals eager over a run of decode steps, with one build for every length."""

import torch

from k2lab import build_model, load_preset
from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import compiled_decode, decode_compile_decision
from k2lab.infer.generate import GenerationConfig, generate
from tests.conftest import randomize


def decode_logits(model, step, prompt: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Prefill ``prompt`` [B, P] eagerly, then feed ``tokens`` [B, N] one step at a time through ``step``;
    then one 3-token step (a speculative verify window). Returns each step's logits."""
    cache = LatentCache(model.config, prompt.shape[0], prompt.shape[1] + tokens.shape[1] + 3)
    model(prompt, cache=cache)
    out = [step(tokens[:, i : i + 1], cache=cache).logits for i in range(tokens.shape[1])]
    out.append(step(tokens[:, :3], cache=cache).logits)
    return out


def test_compiled_decode_equals_eager() -> None:
    """k2-nano, batch 2: six one-token steps and a 3-token step. Dynamo specialises sizes of 1, so one-token
    steps and wider windows are two graphs (batch 1 would be two more); the cache's growth adds none."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = randomize(build_model(load_preset("k2-nano"))).eval()
    vocab = model.config.vocab_size
    prompt, tokens = torch.randint(0, vocab, (2, 7)), torch.randint(0, vocab, (2, 6))
    with torch.inference_mode():
        want = decode_logits(model, model, prompt, tokens)
        step = compiled_decode(model)
        got = decode_logits(model, step, prompt, tokens)
        assert compiled_decode(model) is step  # one compiled step per model
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames <= 2, f"{frames} graphs: the decode step recompiles as the cache grows"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    prompts = [[3, 4, 5, 6], [7, 8]]  # generate reuses the model's compiled step (batch 2, one token)
    compiled_out = generate(model, prompts, GenerationConfig(max_new_tokens=6, compile="on"))
    assert compiled_out == generate(model, prompts, GenerationConfig(max_new_tokens=6, compile="off"))


def test_decode_compile_decision() -> None:
    assert decode_compile_decision("on", "cpu") == (True, "requested")
    assert decode_compile_decision("off", "cuda") == (False, "requested")
    assert decode_compile_decision("auto", "cuda")[0] is True
    assert decode_compile_decision("auto", "cpu")[0] is False
