"""``to_hf(quantize="fp8")``: a DeepseekV3 / Kimi-K2 checkpoint in the released block-FP8 format
(``deepseek-ai/DeepSeek-V3``, ``moonshotai/Kimi-K2-Instruct``), which ``from_hf`` reads back.

Quantised as in the releases: the linear projections of every decoder layer (MTP layers included), i.e.
``model.layers.{i}.`` + ``self_attn.{q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj}``,
``mlp.{gate,up,down}_proj`` (dense layers), ``mlp.shared_experts.{gate,up,down}_proj`` and
``mlp.experts.{e}.{gate,up,down}_proj``; each becomes ``float8_e4m3fn`` + fp32 ``<name>_scale_inv``
[ceil(out/128), ceil(in/128)] (``k2lab.hf.fp8``). Left in the model's dtype as in the releases: embeddings,
``lm_head``, every norm, the router ``mlp.gate`` (+ its bias) and the MTP layers' ``eh_proj`` /
``shared_head`` (vLLM's and SGLang's DeepSeek MTP build ``eh_proj`` as an unquantised Linear).

``config.json`` gets ``quantization_config`` = {"activation_scheme": "dynamic", "fmt": "e4m3",
"quant_method": "fp8", "weight_block_size": [128, 128]}.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from k2lab.hf.fp8 import DEFAULT_FP8_BLOCK, SCALE_SUFFIX, quantize_fp8

__all__ = ["fp8_quantization_config", "fp8_tensors", "quantized_in_release"]

_RELEASE_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate|up|down)_proj)\.weight$"
)


def quantized_in_release(name: str) -> bool:
    """Whether the DeepSeek-V3 / Kimi-K2 FP8 releases store checkpoint tensor ``name`` as FP8."""
    return _RELEASE_QUANTIZED.match(name) is not None


def fp8_quantization_config(block_size: Sequence[int] = DEFAULT_FP8_BLOCK) -> dict[str, Any]:
    """The releases' ``quantization_config``."""
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block_size),
    }


def fp8_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], block_size: Sequence[int] = DEFAULT_FP8_BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a DeepseekV3 checkpoint with the release's projections quantised: each is
    replaced by (name, fp8 weight) and (name + ``_scale_inv``, fp32 scales); the rest pass through."""
    for name, tensor in tensors:
        if quantized_in_release(name):
            quantized, scale_inv = quantize_fp8(tensor, block_size)
            yield name, quantized
            yield name + SCALE_SUFFIX, scale_inv
        else:
            yield name, tensor
