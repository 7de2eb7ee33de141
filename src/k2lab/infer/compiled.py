"""The compiled decode step: ``torch.compile`` (inductor) of the decoder's forward over the latent cache.

A decode step feeds T new tokens per sequence (T = 1 for plain decoding, k + 1 when speculative decoding
verifies a draft) and attends to the S cached rows, so its shapes change at every step. The step is
compiled with dynamic shapes: one graph serves every batch size, context length and T (the cache's length
and write offsets are symbolic, not guarded constants), so there is one build per model and no recompile
as the cache grows. The routed experts take their gathered-weights tier there (few rows, no grad), which
has no data-dependent shapes. Eager stays the reference: compiled logits equal eager's within fp32
rounding over a run of decode steps (tests).

Guards: before every call dynamo checks its guards, and for a model most of them are on module attributes
and parameters (~0.5 ms of a ~3 ms k2-mini step at batch 1 on 2 cores). The step skips those
(``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) and keeps the guards on its inputs, the cache and
the global state (grad mode, …). What a module guard would have caught — a parameter's dtype or device
changed, train/eval switched — is checked here instead: ``compiled_decode`` rebuilds the step when the
model's ``model_state`` differs from the one it was built for; int and float attributes of modules (the
config's: eps, scales, top-k) are constants of the graph, unguarded (``TRACE_CONFIG``). Weights updated in
place (RL) need nothing: parameters are read at every call. Every build is its own region
(``isolate_recompiles``): dynamo files graphs under ``forward``'s code, which all models of a class share, and
without module guards a rebuilt step, or another model of the class (say one routing to 3 experts per token
instead of 2), would find and run a graph built for something else (tests). Isolation costs ≈ 40–70 µs of guard lookup a step (k2-mini,
batch 1: 82–137 against 40–64 µs); each model then builds its own graphs (inductor's cache makes a rebuild
of the same graph ≈ 15 s instead of ≈ 38 s).

``compile`` of ``GenerationConfig`` and ``ServeConfig`` (``k2lab.train.compile.compile_decision``):
"auto" compiles on CUDA and stays eager on CPU, where inductor's C++ build takes minutes on 2 cores —
it pays only for a long-running server or long generations (figures in docs/generation.md).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch

from k2lab.hardware import CompileMode, Precision, compile_decision
from k2lab.infer.decode_weights import bf16_twin, decode_weights_choice, parameter_kinds
from k2lab.ops.kda import mark_compile_constants

__all__ = [
    "CompileMode",
    "built_step",
    "compiled_decode",
    "decode_compile_decision",
    "decode_step",
    "reads_bf16",
]

# Inductor inlines a pointwise result into each consumer unless its body has more than this many ops
# (CPU default 50), and stores (realizes) a pointwise node whose body, producers inlined, grows past it.
# Decode's consumers are reductions over whole weight matrices (the reduction tiers of decode_linear and of
# the routed experts), fed by the broadcast product W[None] * x[:, None] [B, O, D]:
# - too high, an inlined producer — the final RMSNorm's rsqrt and scale before the head, the experts'
#   SiLU(g)·u before their down projection — is recomputed once per weight row instead of once per token
#   (the default 50 against 4: batch 4 +8 %, +9 %, +26 % on a Zen 4, docs/generation.md);
# - too low, a small producer (an RMSNorm's scale, at most the threshold, so inlined) made the product's body
#   pass it, and the product itself was stored: a [B, O, D] buffer written and read back where the weights
#   should only stream (at 4, k2-mini's dense MLP stored its gate and up products, [B, 768, 256] each; at 5,
#   the head's, [8192, B, 256], 33 MB a step at batch 4). ``decode_linear`` now stores its rows first
#   (``stored``), so a product's body is its three ops at any threshold (tests/infer/test_compiled.py).
# Measured on k2-mini, AVX2 Zen 3, 2 threads, in one process against 4 without the stored rows, alternating,
# tokens identical (12 rounds each): 6 with them batch 4 1.10× (quartiles 1.09–1.12), batch 1 1.11×
# (1.06–1.18); 4 with them batch 4 1.06×; 6 without them 1.16× (at 5 without them 0.28×); with and without
# them at 6, equal (1.01×). k3-mini batch 4: 1.00× (0.97–1.01).
REALIZE_OPCOUNT = 6
# On CPU the graph's calling code is generated as C++ (inductor's ``cpp_wrapper``): as Python it allocated the
# buffers and launched the ~100 kernels of a k2-mini step at ≈ 1.1 ms a step (profiler, batch 4). Measured in
# one process against the Python wrapper, alternating, tokens identical: batch 1 1.21×, batch 4 1.07×,
# batch 8 1.08× (medians of 16); the build takes ≈ 15 s longer.
CPP_WRAPPER_DEVICES = ("cpu",)

# Dynamo's settings while it traces: the Python floats the forward reads (norm eps, the rotary attention factor,
# the routing scale, the softmax scale) become constants of the graph. Unspecialized (torch 2.13's default under
# dynamic shapes) each is turned into a scalar tensor input at every call: 31 a k2-mini step. Measured in one
# process against the default, alternating, tokens identical (24 rounds): batch 4 1.05× (quartiles
# 1.02–1.07), batch 1 1.08× (0.99–1.16). Like module attributes, such floats are not guarded (see above).
TRACE_CONFIG = {"specialize_float": True}

# Where a model keeps its compiled step: an attribute of the model itself, so that model and step (which holds
# the model) form a cycle the collector frees with the model. A module-level weak-key registry kept every model
# ever compiled alive, since the value held its own key.
_SLOT = "_k2lab_compiled_decode"


class _StepSlot:
    """A model's compiled step (``built``: (model_state, callable)) and the model it was built for (``owner``,
    weakly). Copies start empty: a copied model builds its own step instead of running its original's graph
    (``copy.copy`` shares the slot, and ``owner`` tells it apart)."""

    __slots__ = ("built", "owner")

    def __init__(self, owner: torch.nn.Module | None = None) -> None:
        self.built: tuple[tuple, Callable[..., object]] | None = None
        self.owner = None if owner is None else weakref.ref(owner)

    def __deepcopy__(self, memo: dict) -> _StepSlot:
        return _StepSlot()

    def __reduce__(self) -> tuple:
        return _StepSlot, ()


def _own_slot(model: torch.nn.Module) -> _StepSlot | None:
    """``model``'s slot if it was made for ``model`` (a shallow copy holds its original's), else None."""
    slot = model.__dict__.get(_SLOT)
    return slot if slot is not None and slot.owner is not None and slot.owner() is model else None


def _slot(model: torch.nn.Module) -> _StepSlot:
    slot = _own_slot(model)
    if slot is None:
        slot = model.__dict__[_SLOT] = _StepSlot(model)
    return slot


def built_step(model: torch.nn.Module) -> Callable[..., object] | None:
    """The compiled step ``compiled_decode`` made for ``model``, or None."""
    slot = _own_slot(model)
    return None if slot is None or slot.built is None else slot.built[1]


def model_state(model: torch.nn.Module) -> tuple:
    """What a compiled step assumes of ``model`` without guarding it: train/eval and every parameter's
    dtype and device."""
    return model.training, parameter_kinds(model)


# torch 2.13's own graph cache per compiled model. An older torch (a GPU machine's own build) has none, so there
# the module guards stay (without them another model of the class could run this one's graph), and inductor
# settings it does not know are left out rather than failing.
_ISOLATE = (
    {"isolate_recompiles": True}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)


def _known(options: dict[str, object]) -> dict[str, object]:
    """``options`` less the inductor settings this torch lacks, and less the skipped module guards
    (``guard_filter_fn``, dynamo's) where builds are not isolated."""
    from torch._inductor import config  # lazy: importing inductor costs seconds

    return {k: v for k, v in options.items() if (k == "guard_filter_fn" and _ISOLATE) or hasattr(config, k)}


def compiled_decode(model: torch.nn.Module) -> Callable[..., object]:
    """``model``'s forward compiled for decode steps (dynamic shapes), built once per model state and reused.

    Call it as the model: ``compiled_decode(model)(ids [B, T], cache=cache).logits``. The build happens at
    the first call; the same model keeps its graph across ``generate`` calls and engine steps, and gets a
    new one when its ``model_state`` changed (module guards are skipped, see the module docstring)."""
    state = model_state(model)
    slot = _slot(model)
    built = slot.built
    if built is None or built[0] != state:
        mark_compile_constants()
        options = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
            "realize_cpu_opcount_threshold": REALIZE_OPCOUNT,
            "cpp_wrapper": next(model.parameters()).device.type in CPP_WRAPPER_DEVICES,
        }
        step = torch.compile(model, dynamic=True, options=_known(options), **_ISOLATE)
        built = slot.built = state, _traced_with(step, TRACE_CONFIG)
    return built[1]


def _traced_with(step: Callable[..., object], settings: dict[str, object]) -> Callable[..., object]:
    """``step`` called under dynamo ``settings``, so that every build (the first call, a new batch kind) traces
    with them; entering them costs ≈ 8 µs a call."""
    patch = torch._dynamo.config.patch(**settings)

    def call(*args: object, **kwargs: object) -> object:
        with patch:
            return step(*args, **kwargs)

    return call


def decode_compile_decision(requested: CompileMode | str, device: str) -> tuple[bool, str]:
    """Whether decode steps on ``device`` run compiled, and why (``k2lab.hardware.compile_decision``)."""
    return compile_decision(
        requested,
        device,
        "CUDA, where the fused step launches once",
        "on CPU inductor's build takes minutes on 2 cores; pays only for long runs",
    )


def decode_step(
    model: torch.nn.Module, requested: CompileMode | str, weights: Precision | str = "fp32"
) -> Callable[..., object]:
    """The callable that runs ``model``'s decode steps: compiled per ``decode_compile_decision``, else the
    model itself. Vision-language models decode eagerly (their text steps are the language model's).
    Compiled on CPU, ``weights`` decides the dtype its matrices are read in
    (``k2lab.infer.decode_weights.decode_weights_choice``): bf16 runs the step on ``bf16_twin(model)``. The
    default, fp32, is for callers that do not choose; generation, serving and drafts pass their config's
    ``decode_weights``."""
    device = next(model.parameters()).device.type
    if hasattr(model, "language_model") or not decode_compile_decision(requested, device)[0]:
        return model
    return compiled_decode(bf16_twin(model) if reads_bf16(requested, weights, device) else model)


def reads_bf16(requested: CompileMode | str, weights: Precision | str, device: str) -> bool:
    """Whether a decode step on ``device`` runs compiled with its matrices read as bf16 (its twin's)."""
    compiled = decode_compile_decision(requested, device)[0]
    return compiled and decode_weights_choice(weights, device, compiled).dtype == torch.bfloat16
