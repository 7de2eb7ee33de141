"""QK-Clip (Kimi K2 report, Algorithm 1), MLA-aware and per head.

After the optimizer step, for every attention head h whose maximum pre-softmax logit on the last batch

    S_max^h = max_{X ∈ batch} max_{i ≥ j, valid} softmax_scale · q_i^h · k_j^h

exceeds τ, rescale that head's query/key projections with γ_h = τ / S_max^h:

    W_qc^h ×= γ_h^α        (q nope rows of q_up / q_proj)
    W_kc^h ×= γ_h^(1−α)    (k nope rows of kv_up)
    W_qr^h ×= γ_h          (q rope rows: the shared rope key k_R is not touched, so one head's clip
                           does not change any other head)

Value rows, q_down / kv_down and the norms are untouched. Every logit of a clipped head is then exactly
γ_h times what it was (nope part γ^α·γ^(1−α), rope part γ·1), so re-running the same batch gives
S_max^h = τ. Under data parallelism the maxima are all-reduced with MAX before clipping.
Defaults τ = 100, α = 0.5 (the report); K2 run facts in facts.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from k2lab.nn.mla import MultiHeadLatentAttention
from k2lab.optim import dtensor


@dataclass
class ClipStats:
    """What one clip did: the per-layer maxima it saw and how many heads it rescaled."""

    max_logits: list[torch.Tensor]  # per layer [H], before clipping
    clipped_heads: int
    clipped_mask: list[torch.Tensor] = field(default_factory=list)  # per layer [H] bool


def all_reduce_max(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """MAX-reduce per-layer maxima across data-parallel ranks (no-op without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return values
    flat = torch.cat([v.reshape(-1) for v in values])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    return list(flat.split([v.numel() for v in values]))


@torch.no_grad()
def clip_head_weights(attn: MultiHeadLatentAttention, gamma: torch.Tensor, alpha: float = 0.5) -> None:
    """Scale one layer's per-head q/k projection rows by γ [H] (γ = 1 leaves a head bit-identical).

    Works on plain and FSDP2-sharded (DTensor) weights alike: a per-row factor is built for the whole
    matrix and multiplied in, so each rank scales exactly the rows it holds.
    """
    if bool((gamma == 1).all()):
        return
    n, r, v = attn.nope_dim, attn.rope_dim, attn.v_dim
    gamma = gamma.float()
    ones = torch.ones_like(gamma)
    q_weight = attn.q_proj.weight if hasattr(attn, "q_proj") else attn.q_up.weight
    _scale_rows(q_weight, _per_head_rows([(gamma.pow(alpha), n), (gamma, r)]))
    _scale_rows(attn.kv_up.weight, _per_head_rows([(gamma.pow(1 - alpha), n), (ones, v)]))


def _per_head_rows(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """[(factor [H], rows), ...] -> one factor per weight row [H·Σrows], head-major as the weights lay out."""
    return torch.cat([factor[:, None].expand(-1, rows) for factor, rows in parts], dim=1).reshape(-1)


def _scale_rows(weight: torch.Tensor, row_factor: torch.Tensor) -> None:
    weight.mul_(dtensor.like(row_factor[:, None].to(weight.device), weight))


def _module_list(value: object) -> list[torch.nn.Module] | None:
    """``value`` as a list of layers where it is one (a ModuleList, Sequential, list or tuple), else None."""
    if isinstance(value, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)):
        return list(value)
    return None


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """k2lab's ``model.blocks()`` (main layers, then MTP blocks, k2lab.models.mtp), else ``model.layers``;
    a user model's ``blocks`` / ``layers`` attribute of another kind (a ModuleList, an int) is read as a
    list where it is one, never called."""
    blocks = getattr(model, "blocks", None)
    if callable(blocks) and not isinstance(blocks, torch.nn.Module):
        return _module_list(blocks())
    return _module_list(blocks) or _module_list(getattr(model, "layers", None))


def _attn_id(layer: torch.nn.Module) -> int | None:
    """``id`` of a decoder layer's ``attn`` (None for a layer without one, e.g. torch's encoder layers)."""
    attn = getattr(layer, "attn", None)
    return None if attn is None else id(attn)


class QKClip:
    """Applies per-head QK-Clip to every MLA layer of a model from the maxima its forward recorded.

    Only k2lab's ``MultiHeadLatentAttention`` records the per-head maxima QK-Clip needs: on a model without
    one (``nn.MultiheadAttention``, a user's own attention) there is nothing to clip and this is a no-op
    (``MuonClip`` with ``name="muonclip"`` refuses such a model instead).
    """

    def __init__(self, model: torch.nn.Module, tau: float = 100.0, alpha: float = 0.5) -> None:
        if tau <= 0 or not 0 <= alpha <= 1:
            raise ValueError(f"QK-Clip needs tau > 0 and alpha in [0, 1], got tau={tau}, alpha={alpha}")
        self.tau = tau
        self.alpha = alpha
        self.layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
        # Decoder layer index of each MLA (hybrids interleave KDA layers, which have no logits to clip).
        attn_ids = [id(attn) for attn in self.layers]
        decoder_layers = _decoder_layers(model)
        indices = [i for i, layer in enumerate(decoder_layers or []) if _attn_id(layer) in attn_ids]
        self.layer_indices = indices if len(indices) == len(self.layers) else list(range(len(self.layers)))
        # the MLA layers every forward runs (not an MTP block, which a forward of the main model skips)
        main = _module_list(getattr(model, "layers", None))
        main_attns = {_attn_id(layer) for layer in main} if main is not None else set(attn_ids)
        self.always_run = [attn for attn in self.layers if id(attn) in main_attns]
        self.ever_clipped = [torch.zeros(a.n_heads, dtype=torch.bool) for a in self.layers]

    def record(self, enabled: bool = True) -> None:
        """Turn per-head max-logit recording on (training forwards) or off."""
        for attn in self.layers:
            attn.record_max_logits = enabled

    def recorded_maxima(self) -> list[torch.Tensor]:
        """Per-layer S_max [H] over every forward since the last call (e.g. all micro-batches of a step),
        MAX-reduced over data-parallel ranks. Reading clears them for the next step.

        A layer no forward ran since (an MTP block while RL scores the main model only) reads −∞: nothing
        was measured, so nothing is clipped. With no layer recorded at all, recording was never turned on or
        no forward ran: a ``RuntimeError``, unless recording is on and every MLA layer is an MTP block (an
        all-KDA main stack), whose forwards without MTP measure nothing: all −∞.
        """
        if self.layers and all(attn.max_logits is None for attn in self.layers):
            recording = any(attn.record_max_logits for attn in self.layers)
            if self.always_run or not recording:
                raise RuntimeError("no max logits recorded: call QKClip.record() before the forward pass")
        maxima = []
        for attn in self.layers:
            unmeasured = attn.max_logits is None
            maxima.append(torch.full((attn.n_heads,), -math.inf) if unmeasured else attn.max_logits.float())
            attn.max_logits = None
        return all_reduce_max(maxima)

    @torch.no_grad()
    def apply(self, maxima: list[torch.Tensor] | None = None) -> ClipStats:
        """Clip heads whose S_max > τ (maxima default to what the last forward recorded)."""
        maxima = self.recorded_maxima() if maxima is None else maxima
        clipped, masks = 0, []
        for index, (attn, s_max) in enumerate(zip(self.layers, maxima, strict=True)):
            over = s_max > self.tau
            gamma = torch.where(over, self.tau / s_max.clamp(min=1e-12), torch.ones_like(s_max))
            clip_head_weights(attn, gamma, self.alpha)
            self.ever_clipped[index] |= over.cpu()
            clipped += int(over.sum())
            masks.append(over)
        return ClipStats(max_logits=maxima, clipped_heads=clipped, clipped_mask=masks)

    @property
    def ever_clipped_fraction(self) -> float:
        heads = sum(m.numel() for m in self.ever_clipped)
        return sum(int(m.sum()) for m in self.ever_clipped) / max(heads, 1)
