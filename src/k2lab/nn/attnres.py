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
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from k2lab.nn.norm import RMSNorm

__all__ = ["AttnRes", "BlockAttnResState", "attnres", "attnres_reference", "source_inverse_rms"]


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
    when the caller keeps them, as ``BlockAttnResState`` does for completed blocks). With gradients (eager) it
    runs as ``_AttnRes``, whose backward is written out; :func:`attnres_reference` is the same forward for
    autograd (and for torch.compile).
    """
    if not sources:
        raise ValueError("attnres needs at least one source")
    tensors = (query, key_norm_weight, *sources)
    if (
        not torch.is_grad_enabled()
        or not any(t.requires_grad for t in tensors)
        or torch.compiler.is_compiling()
    ):
        return attnres_reference(query, sources, key_norm_weight, eps, inverse_rms)
    values = [source.float() for source in sources]
    with torch.no_grad():  # r_i's dependence on v_i is in _AttnRes's backward
        if inverse_rms is None:
            inverse_rms = [source_inverse_rms(v, eps) for v in values]
        inverse_rms = [r.detach() for r in inverse_rms]
    return _AttnRes.apply(query, key_norm_weight, len(values), *values, *inverse_rms).to(sources[0].dtype)


def attnres_reference(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    key_norm_weight: torch.Tensor,
    eps: float = 1e-6,
    inverse_rms: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`attnres` by autograd through its forward (the reference tier of ``_AttnRes``'s backward)."""
    values = [source.float() for source in sources]
    if inverse_rms is None:
        inverse_rms = [source_inverse_rms(v, eps) for v in values]
    return _mixture(query, key_norm_weight, values, inverse_rms)[0].to(sources[0].dtype)


def _mixture(
    query: torch.Tensor,
    key_norm_weight: torch.Tensor,
    values: Sequence[torch.Tensor],
    inverse_rms: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h [..., D], the weights a [S, ...], p = w ⊙ g [D], the logits z [S, ...]) for fp32 values [..., D]
    and r_i [...]."""
    projected = query.float() * key_norm_weight.float()  # w ⊙ g [D]
    # in fp32 under autocast too, which would round every v_i to bf16 for its product (a cast per source)
    with torch.autocast(projected.device.type, enabled=False):
        logits = torch.stack(
            [(v @ projected) * r for v, r in zip(values, inverse_rms, strict=True)]
        )  # [S, ...]
    weights = logits.softmax(dim=0)  # [S, ...]
    h = weights[0].unsqueeze(-1) * values[0]
    for weight, value in zip(weights[1:], values[1:], strict=True):
        h = torch.addcmul(h, weight.unsqueeze(-1), value)
    return h, weights, projected, logits


class _AttnRes(torch.autograd.Function):
    """``_mixture`` with its backward written out. With z_i = r_i (v_i · p), a = softmax(z), h = Σ_i a_i v_i,
    and dh the incoming gradient (per token, D the width):

        da_i = dh · v_i,   dz_i = a_i (da_i − Σ_j a_j da_j)
        dv_i = a_i dh + dz_i r_i p − (dz_i z_i r_i² / D) v_i      (the last term: r_i's dependence on v_i,
                                                                   ∂r_i/∂v_i = −r_i³ v_i / D)
        dp = Σ_tokens Σ_i dz_i r_i v_i,   dw = dp ⊙ g,   dg = dp ⊙ w

    The r_i come in detached (computed from the v_i, or kept by the caller for completed blocks): autograd
    through ``source_inverse_rms`` (its pow, mean and rsqrt, broadcast back over D) took most of the backward's
    time, and autograd's chain through the stack, softmax, matrix-vector products and ``addcmul`` ≈ 2× the
    passes over the [..., D] tensors.
    """

    @staticmethod
    def forward(ctx, query, key_norm_weight, n_sources, *tensors):  # noqa: ANN001, ANN205 - autograd protocol
        values, inverse_rms = tensors[:n_sources], tensors[n_sources:]
        h, weights, projected, logits = _mixture(query, key_norm_weight, values, inverse_rms)
        ctx.save_for_backward(query, key_norm_weight, projected, weights, logits, *values, *inverse_rms)
        ctx.n_sources = n_sources
        return h

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, dh):  # noqa: ANN001, ANN205 - autograd.Function protocol
        query, key_norm_weight, projected, weights, logits, *rest = ctx.saved_tensors
        values, inverse_rms = rest[: ctx.n_sources], rest[ctx.n_sources :]
        dh = dh.float()
        width = dh.shape[-1]
        d_weights = torch.stack([torch.linalg.vecdot(dh, v) for v in values])  # da_i [S, ...]
        d_logits = weights * (d_weights - (weights * d_weights).sum(0, keepdim=True))  # dz_i
        d_values = []
        d_projected = torch.zeros_like(projected)
        for weight, logit, d_logit, value, r in zip(
            weights, logits, d_logits, values, inverse_rms, strict=True
        ):
            scaled = d_logit * r  # dz_i r_i [...]
            through_rms = d_logit * logit * r.square() / -width  # −dz_i z_i r_i² / D
            d_value = torch.addcmul(weight.unsqueeze(-1) * dh, scaled.unsqueeze(-1), projected)
            d_values.append(d_value.addcmul_(through_rms.unsqueeze(-1), value))
            d_projected += scaled.reshape(-1) @ value.reshape(-1, width)
        d_query = (d_projected * key_norm_weight.float()).to(query.dtype)
        d_key_norm = (d_projected * query.float()).to(key_norm_weight.dtype)
        return d_query, d_key_norm, None, *d_values, *([None] * ctx.n_sources)


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


@dataclass(eq=False)
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

    A dataclass so that FSDP2, given it as a layer's input, finds its tensors and hooks them: the layer's
    gradients are then reduced, and its gathered weights freed, as soon as its backward is done. FSDP2 passes
    the layer a copy holding the hooked tensors, so the caller takes the layer's result (the partial sum).
    """

    embedding: torch.Tensor  # [..., D]
    block_size: int
    completed: list[torch.Tensor] = field(default_factory=list)  # completed block sums, [..., D] each
    partial: torch.Tensor | None = None
    block_rms: dict[float, list[torch.Tensor]] = field(default_factory=dict)  # per ε: r of each of blocks

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def blocks(self) -> list[torch.Tensor]:
        """[embedding, completed block sums …]."""
        return [self.embedding, *self.completed]

    def start_layer(self, layer_idx: int) -> None:
        """Call before layer ``layer_idx``'s attention: at a block boundary the partial sum becomes a block."""
        if layer_idx > 0 and layer_idx % self.block_size == 0 and self.partial is not None:
            self.completed.append(self.partial)
            self.partial = None

    def add(self, output: torch.Tensor) -> None:
        """Add a sub-layer's output (attention or MLP, [..., D]) to the current partial block sum.

        The sum is kept in the embedding's dtype (the residual-stream dtype: fp32 under bf16 autocast), as
        ``h + f(h)`` would be in a plain residual stream.
        """
        output = output.to(self.embedding.dtype)
        self.partial = output if self.partial is None else self.partial + output

    def sources(self) -> list[torch.Tensor]:
        """[embedding, completed blocks …, partial (if not empty)], each [..., D]."""
        return self.blocks if self.partial is None else [*self.blocks, self.partial]

    def inverse_rms(self, eps: float) -> list[torch.Tensor]:
        """``source_inverse_rms`` of each of ``sources()``: kept for the embedding and completed blocks (read
        by every later sub-layer), computed afresh for the partial sum (it changes after every read)."""
        kept = self.block_rms.setdefault(eps, [])
        kept.extend(source_inverse_rms(block, eps) for block in self.blocks[len(kept) :])
        return kept if self.partial is None else [*kept, source_inverse_rms(self.partial, eps)]
