"""The compiled decode step equals eager over a run of decode steps, with one build for every length."""

import re

import torch
from torch._inductor.utils import run_and_get_code

from k2lab import build_model, load_preset
from k2lab.config import ModelConfig
from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import (
    REALIZE_OPCOUNT,
    _known,
    compiled_decode,
    decode_compile_decision,
    model_state,
)
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.nn.decode_linear import decode_linear
from k2lab.nn.mlp import GatedMLP
from k2lab.nn.norm import RMSNorm
from tests.conftest import randomize


def decode_logits(
    model, step, prompt: torch.Tensor, tokens: torch.Tensor, window: bool = True
) -> list[torch.Tensor]:
    """Prefill ``prompt`` [B, P] eagerly, then feed ``tokens`` [B, N] one step at a time through ``step``;
    then (``window``) one 3-token step, a speculative verify window. Returns each step's logits."""
    cache = LatentCache(model.config, prompt.shape[0], prompt.shape[1] + tokens.shape[1] + 3)
    model(prompt, cache=cache)
    out = [step(tokens[:, i : i + 1], cache=cache).logits for i in range(tokens.shape[1])]
    if window:
        out.append(step(tokens[:, :3], cache=cache).logits)
    return out


def test_compiled_decode_equals_eager(monkeypatch) -> None:
    """k2-nano, batch 2, then batch 1: six one-token steps and a 3-token step each. Dynamo specialises sizes
    of 1, so one-token steps and wider windows are two graphs per batch kind (every step here has at most
    6 rows: the reduction tier of ``decode_linear`` and the routed experts); the cache's growth adds none.
    Module guards are skipped: weights changed in place are read at the next call. The LM head and the
    dense layer's MLP (k2-nano's largest weights) take the weight-row-major form of large weights, as
    k2-mini's head does (inductor once misread a transposed product feeding the next RMSNorm)."""
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # counters outlive reset()
    torch.manual_seed(0)
    model = randomize(build_model(load_preset("k2-nano"))).eval()
    head = model.lm_head.weight
    monkeypatch.setattr("k2lab.nn.decode_linear.LARGE_WEIGHT_BYTES", head.numel() * head.element_size())
    vocab = model.config.vocab_size
    prompt, tokens = torch.randint(0, vocab, (2, 7)), torch.randint(0, vocab, (2, 6))
    with torch.inference_mode():
        step = compiled_decode(model)
        for batch in (2, 1):
            want = decode_logits(model, model, prompt[:batch], tokens[:batch])
            got = decode_logits(model, step, prompt[:batch], tokens[:batch])
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert compiled_decode(model) is step  # one compiled step per model
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        assert frames <= 4, f"{frames} graphs: the decode step recompiles as the cache grows"
        model.layers[1].mlp.experts.up_proj.mul_(-2.0)  # an update in place (RL): no guard, no rebuild
        model.lm_head.weight.add_(0.5)
        want = decode_logits(model, model, prompt, tokens)
        got = decode_logits(model, step, prompt, tokens)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == frames
    prompts = [[3, 4, 5, 6], [7, 8]]  # generate reuses the model's compiled step (batch 2, one token)
    on = GenerationConfig(max_new_tokens=6, compile="on", decode_weights="fp32")  # bf16: test_decode_weights
    compiled_out = generate(model, prompts, on)
    assert compiled_out == generate(model, prompts, GenerationConfig(max_new_tokens=6, compile="off"))


def test_compiled_decode_rebuilds_when_the_model_state_changes(monkeypatch) -> None:
    """What a skipped module guard would have caught (train/eval, a parameter's dtype) gives a new step,
    and the new step compiles its own graph rather than reusing the one built for the old state."""
    monkeypatch.setattr("k2lab.infer.compiled.CPP_WRAPPER_DEVICES", ())  # guards only: the quicker build
    torch.manual_seed(0)
    model = build_model(load_preset("k2-nano")).eval()
    step = compiled_decode(model)
    assert compiled_decode(model) is step
    ids = torch.randint(0, model.config.vocab_size, (2, 1))
    with torch.no_grad():
        step(ids)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        model.train()
        trained = compiled_decode(model)
        assert trained is not step
        torch.testing.assert_close(trained(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
    model.eval().double()
    assert compiled_decode(model) not in (step, trained)
    assert model_state(model) == (False, frozenset({(torch.float64, torch.device("cpu"))}))


def test_models_of_one_class_get_their_own_compiled_steps(monkeypatch) -> None:
    """Dynamo files compiled graphs under ``forward``'s code, which every model of a class shares; with
    module guards skipped, a model routing to 3 experts per token would run the graph of one routing to 2
    (nothing in the inputs differs). Each build is isolated."""
    monkeypatch.setattr("k2lab.infer.compiled.CPP_WRAPPER_DEVICES", ())  # guards only: the quicker build
    torch.manual_seed(0)
    config = load_preset("k2-nano")
    two = randomize(build_model(config)).eval()
    three = randomize(build_model(ModelConfig(**{**config.model_dump(), "num_experts_per_tok": 3}))).eval()
    prompt, tokens = torch.randint(0, config.vocab_size, (2, 5)), torch.randint(0, config.vocab_size, (2, 3))
    with torch.inference_mode():
        for model in (two, three):
            want = decode_logits(model, model, prompt, tokens, window=False)
            got = decode_logits(model, compiled_decode(model), prompt, tokens, window=False)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_decode_compile_decision() -> None:
    assert decode_compile_decision("on", "cpu") == (True, "requested")
    assert decode_compile_decision("off", "cuda") == (False, "requested")
    assert decode_compile_decision("auto", "cuda")[0] is True
    assert decode_compile_decision("auto", "cpu")[0] is False


def test_compiled_step_traces_with_floats_specialized(monkeypatch) -> None:
    """Every call of the compiled step (so every build) runs under ``TRACE_CONFIG``; nothing leaks out."""
    seen = []
    monkeypatch.setattr(
        torch,
        "compile",
        lambda model, **_: lambda *a, **k: seen.append(torch._dynamo.config.specialize_float),
    )
    step = compiled_decode(build_model(load_preset("k2-nano")))
    step(None)
    step(None)
    assert seen == [True, True]
    assert not torch._dynamo.config.specialize_float


def stored_products(threshold: int, monkeypatch) -> list[str]:
    """The buffers of a compiled decode pattern (RMSNorm → gated MLP → residual → RMSNorm → head, 3 rows)
    whose shape holds a weight's [O, D]: the broadcast products of ``decode_linear`` stored instead of streamed
    into their sums. The graph is built as ``compiled_decode`` builds it, Python wrapper so its buffers show."""
    torch.manual_seed(0)
    norm, final, mlp = RMSNorm(64), RMSNorm(64), GatedMLP(64, 192)
    head = torch.nn.Linear(64, 512, bias=False)
    for weight in (norm.weight, final.weight):
        torch.nn.init.normal_(weight, 1.0, 0.1)
    # the head takes the [O, N] form of large weights
    monkeypatch.setattr("k2lab.nn.decode_linear.LARGE_WEIGHT_BYTES", head.weight.numel() * 4)

    def step(x: torch.Tensor) -> torch.Tensor:
        h = x + mlp(norm(x))
        return decode_linear(final(h), head.weight)

    torch._dynamo.reset()
    options = {"realize_cpu_opcount_threshold": threshold, "cpp_wrapper": False}
    compiled = torch.compile(step, dynamic=True, options=options)
    x = torch.randn(3, 1, 64)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x)
        torch.testing.assert_close(out, step(x), rtol=1e-4, atol=1e-5)
    weights = [set(p.shape) for p in (*mlp.parameters(), head.weight)]
    shapes = re.findall(r"empty_strided_cpu\(\((.*?)\),", "\n".join(codes))
    return [s for s in shapes if any(w <= {int(d) for d in re.findall(r"\b\d+\b", s)} for w in weights)]


def test_decode_products_stream_their_weights(monkeypatch) -> None:
    """No [B, O, D] product is stored: ``decode_linear`` stores its rows first (without that, this pattern
    stores the MLP's gate and up products at threshold 6 and the head's at 4; k2-mini's step stored its dense
    MLP's at 4 and its head's at 5)."""
    assert stored_products(REALIZE_OPCOUNT, monkeypatch) == []


def test_compile_settings_this_torch_lacks_are_left_out(monkeypatch):
    options = {"guard_filter_fn": len, "cpp_wrapper": True, "a_setting_no_torch_has": 1}
    assert _known(options) == {"guard_filter_fn": len, "cpp_wrapper": True}
    monkeypatch.setattr("k2lab.infer.compiled._ISOLATE", {})  # no isolate_recompiles: module guards kept
    assert _known(options) == {"cpp_wrapper": True}


def test_a_compiled_model_is_freed_and_its_copies_build_their_own_step() -> None:
    """The step lives on its model (a cycle the collector frees), and a copy, deep or shallow, gets a new
    step rather than its original's graph. Nothing is built: the steps are never called."""
    import copy
    import gc
    import weakref

    from k2lab.infer.compiled import built_step

    model = build_model(load_preset("k2-nano")).eval()
    step = compiled_decode(model)
    assert built_step(model) is step and compiled_decode(model) is step
    for twin in (copy.deepcopy(model), copy.copy(model)):
        assert built_step(twin) is None and compiled_decode(twin) is not step
        assert compiled_decode(model) is step
    ref = weakref.ref(model)
    del model, step, twin
    gc.collect()
    assert ref() is None, "a compiled model outlived its last reference"


def _traced_products(step, *args, **kwargs) -> tuple[list[tuple[int, ...]], set[str]]:
    """What dynamo records for ``step(*args, **kwargs)`` (a capturing backend, no inductor build): the weight
    shapes of its ``F.linear`` calls, and every call target."""
    linears: list[tuple[int, ...]] = []
    targets: set[str] = set()

    def capture(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        for node in graph_module.graph.nodes:
            if node.op.startswith("call_"):
                targets.add(str(node.target))
            if node.target is torch.nn.functional.linear:
                linears.append(tuple(node.args[1].meta["example_value"].shape))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(step, backend=capture, dynamic=True)(*args, **kwargs)
    return linears, targets


def test_compiled_window_of_many_rows_equals_eager() -> None:
    """A 3-token window at batch 5: 15 rows, past ``decode_linear.MAX_ROWS`` (the reduction tier takes up to
    ``COMPILED_MAX_ROWS``), and 30 (token, pick) rows for k2-nano's 8 experts (the gathered tier in expert
    order up to ``experts.GATHERED_MAX_ROWS``): no product but the router's is left to ``F.linear``, none to the
    grouped experts, and the compiled window equals eager within fp32 rounding."""
    torch.manual_seed(1)
    model = randomize(build_model(load_preset("k2-nano"))).eval()
    vocab = model.config.vocab_size
    prompt, window = torch.randint(0, vocab, (5, 6)), torch.randint(0, vocab, (5, 3))

    def prefilled() -> LatentCache:
        cache = LatentCache(model.config, 5, 9)
        model(prompt, cache=cache)
        return cache

    def run(step) -> torch.Tensor:
        return step(window, cache=prefilled()).logits

    with torch.inference_mode():
        linears, targets = _traced_products(model, window, cache=prefilled())
        router = tuple(model.layers[1].mlp.router.weight.shape)  # fp32 scores: its own F.linear, not twinned
        assert linears == [router], linears
        assert not any("grouped_mm" in t for t in targets) and any("argsort" in t for t in targets)
        torch._dynamo.reset()
        torch.testing.assert_close(run(compiled_decode(model)), run(model), rtol=1e-4, atol=1e-5)
