"""Block Attention Residuals (K3): each sub-layer reads a learned softmax mixture of depth-wise sources.

For sources v_0 … v_{S−1} (each [..., D]) and the sub-layer's pseudo-query w [D] (arXiv 2603.15031):

    k_i = RMSNorm(v_i) ⊙ g                       key norm with weight g [D]
    a_i = exp(w·k_i) / Σ_j exp(w·k_j)            softmax over the S sources, per token       a [S, ...]
    h   = Σ_i a_i v_i                            values raw (not normalised)                 h [..., D]

all in fp32, cast back to the first source's (the embedding's) dtype. w starts at zero, so h starts as the plain mean of the sources.

Block AttnRes (the sources a decoder keeps, ``BlockAttnResState``, block size B in decoder layers):
    sources = [embedding, completed block sums …, current partial block sum (left out while empty)]
The partial sum adds up the attention and MLP outputs of every layer in the current block (the embedding is
its own source, never part of a partial sum). At the start of layer l with l % B == 0 and l > 0 the partial
sum becomes a completed block and a new, empty one starts. Every layer applies one AttnRes before attention
and one before the MLP (own query and key norm each), both followed by the usual pre-norm RMSNorm; the decoder
applies a last one before the final norm. So layer 0's attention sees only the embedding (h = embedding), and
the storage is O(blocks · D) per token instead of O(layers · D). This is flash-linear-attention's RetNet
``attnres_block_size`` with its sub-layer count = 2·B.

Checked against the released code (mlx-lm 0.32.2 ``kimi_k3``, vLLM's portable K3; tests/hf/test_kimi_k3_mlx.py
compares logits): there the block list starts empty and layer l first reads ``AttnRes(blocks, partial)`` (the
embedding alone at l = 0), *then*, when l % B == 0, pushes the partial sum as a block and starts a new one with
the attention output. The read before a block-opening layer's attention therefore sees the block that layer
closes as its last source, exactly the sources ``start_layer`` gives it here (same values, same order). Each
source's logit is ``(v_i · (norm.weight ⊙ proj.weight)) · rsqrt(mean(v_i²) + rms_norm_eps)`` (checkpoint names
``*_res_proj.weight`` [1, D] = ``query``, ``*_res_norm.weight`` = ``key_norm``; ε = ``rms_norm_eps``); the
softmax runs over sources in fp32 and mixes the raw v_i. So for K3 (B = 12, 93 layers) the output AttnRes reads
the embedding, 7 completed 12-layer blocks and the partial block of layers 84-92.
Where the report differs, this follows the code: the report writes one AttnRes per layer over the embedding and
earlier layer/block outputs ("eight 12-layer blocks plus a partial block"); the code has two per layer (before
attention and before the MLP, each with its own query and norm) plus one before the final norm, and each reads
the current block's partial sum too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from k2lab.nn.norm import RMSNorm

__all__ = ["AttnRes", "BlockAttnResState", "attnres", "source_inverse_rms"]


def source_inverse_rms(source: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """r = 1 / √(mean(v²) + ε) of a source [..., D] -> [...] in fp32 (RMSNorm(v) = r·v)."""
    return torch.rsqrt(source.float().pow(2).mean(-1) + eps)


def attnres(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_norm_weight: torch.Tensor,
    eps: float = 1e-6,
    inverse_rms: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """h = Σ_i softmax_i(query · RMSNorm(v_i) ⊙ key_norm_weight) v_i.

    query [D], sources S ≥ 1 tensors [..., D] of one shape, key_norm_weight [D] -> [..., D] in the first
    source's dtype; computed in fp32. The keys are never materialised: w · (r_i v_i ⊙ g) = r_i (v_i · (w ⊙ g)),
    one matrix-vector product per source, with r_i = ``source_inverse_rms(v_i)`` (passed in ``inverse_rms``
    when the caller keeps them, as ``BlockAttnResState`` does for completed blocks).
    """
    if not sources:
        raise ValueError("attnres needs at least one source")
    values = [source.float() for source in sources]
    if inverse_rms is None:
        inverse_rms = [source_inverse_rms(v, eps) for v in values]
    projected = query.float() * key_norm_weight.float()  # w ⊙ g [D]
    logits = torch.stack([(v @ projected) * r for v, r in zip(values, inverse_rms, strict=True)])  # [S, ...]
    weights = logits.softmax(dim=0).unsqueeze(-1)  # [S, ..., 1]
    h = weights[0] * values[0]
    for weight, value in zip(weights[1:], values[1:], strict=True):
        h = torch.addcmul(h, weight, value)
    return h.to(sources[0].dtype)


class AttnRes(nn.Module):
    """One AttnRes: ``query`` [D] (pseudo-query, zero at init) and ``key_norm`` (RMSNorm weight [D], ones).

    sources: a sequence of S tensors [..., D] (e.g. ``BlockAttnResState.sources()``) -> [..., D].
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm = RMSNorm(hidden_size, eps)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """query ← 0 (uniform mixture at init), key norm weight ← 1."""
        self.query.zero_()
        self.key_norm.weight.fill_(1.0)

    def forward(
        self, sources: Sequence[torch.Tensor], inverse_rms: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        return attnres(self.query, sources, self.key_norm.weight, self.key_norm.eps, inverse_rms)

    def read(self, state: BlockAttnResState) -> torch.Tensor:
        """The mixture of ``state``'s sources, with the completed blocks' key statistics computed once."""
        return self(state.sources(), state.inverse_rms(self.key_norm.eps))


class BlockAttnResState:
    """The depth-wise sources of Block AttnRes during one forward pass (no parameters).

    Decoder use (``block_size`` = B decoder layers; ``attn_res`` / ``mlp_res`` / ``final_res`` are AttnRes)::

        state = BlockAttnResState(embed(ids), block_size)
        for l, layer in enumerate(layers):
            state.start_layer(l)                              # closes the block when l % B == 0, l > 0
            a = layer.attn(layer.attn_norm(layer.attn_res.read(state)))   # = attn_res(state.sources())
            state.add(a)
            f = layer.mlp(layer.mlp_norm(layer.mlp_res.read(state)))
            state.add(f)
        logits = lm_head(norm(final_res.read(state)))
    """

    def __init__(self, embedding: torch.Tensor, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = [embedding]  # embedding, then completed block sums
        self.partial: torch.Tensor | None = None
        self._block_rms: dict[float, list[torch.Tensor]] = {}  # per ε: r of each completed block

    def start_layer(self, layer_idx: int) -> None:
        """Call before layer ``layer_idx``'s attention: at a block boundary the partial sum becomes a block."""
        if layer_idx > 0 and layer_idx % self.block_size == 0 and self.partial is not None:
            self.blocks.append(self.partial)
            self.partial = None

    def add(self, output: torch.Tensor) -> None:
        """Add a sub-layer's output (attention or MLP, [..., D]) to the current partial block sum.

        The sum is kept in the embedding's dtype (the residual-stream dtype: fp32 under bf16 autocast), as
        ``h + f(h)`` would be in a plain residual stream.
        """
        output = output.to(self.blocks[0].dtype)
        self.partial = output if self.partial is None else self.partial + output

    def sources(self) -> list[torch.Tensor]:
        """[embedding, completed blocks …, partial (if not empty)], each [..., D]."""
        return [*self.blocks] if self.partial is None else [*self.blocks, self.partial]

    def inverse_rms(self, eps: float) -> list[torch.Tensor]:
        """``source_inverse_rms`` of each of ``sources()``: kept for the embedding and completed blocks (read
        by every later sub-layer), computed afresh for the partial sum (it changes after every read)."""
        kept = self._block_rms.setdefault(eps, [])
        kept.extend(source_inverse_rms(block, eps) for block in self.blocks[len(kept) :])
        return kept if self.partial is None else [*kept, source_inverse_rms(self.partial, eps)]
