"""The compiled training step: ``torch.compile`` (inductor) of the model's forward, and so of its backward.

The whole decoder traces as one graph without breaks: the routed experts' grouped matmul is the custom op
``k2lab::grouped_mm`` with a fake-tensor rule and its own backward (``k2lab.ops.grouped_mm``), the expert
counts are a static-shape scatter (``k2lab.nn.experts.expert_counts``) instead of ``bincount``, and the
QK-Clip max-logit recording is an attribute write dynamo replays after the graph. Eager stays the reference:
compiled logits, gradients, recorded maxima and expert loads equal eager's within fp32 rounding (tests).

``TrainConfig.compile``:

    "on"    compile the training forward (validation and sampling stay eager: other shapes, no grad)
    "off"   eager
    "auto"  on where it pays: CUDA (kernels fuse and launch once); off on CPU, where inductor's C++ build
            takes 60–75 s on 2 cores for k2-mini and wins 4–13 % of its step (matmul-bound), and takes ~5 min
            for k3-mini, whose elementwise-heavy step it makes 2.1× faster (measured on an AMD EPYC with
            AVX512-BF16): neither build pays back within a minute; "on" for long K3 runs
"""

from __future__ import annotations

import torch

from k2lab.hardware import CompileMode
from k2lab.hardware import compile_decision as hardware_compile_decision
from k2lab.ops.kda import mark_compile_constants

__all__ = ["CompileMode", "compile_decision", "compiled"]


def compile_decision(requested: CompileMode | str, device: str) -> tuple[bool, str]:
    """Whether to compile the training forward on ``device`` and why (``k2lab.hardware.compile_decision``)."""
    return hardware_compile_decision(
        requested,
        device,
        "CUDA, where fused kernels pay from the first steps",
        "on CPU inductor's build (~1 min on 2 cores) costs more than it saves (4–13 % a step)",
    )


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` compiled with inductor (static shapes: one graph per sequence length)."""
    mark_compile_constants()
    return torch.compile(model, dynamic=False)
