"""MuonClip = Muon (+ AdamW groups) followed by per-head QK-Clip, with stability telemetry.

One call per training step, after ``loss.backward()``::

    stats = muonclip.step()      # optimizer update, then QK-Clip on the maxima of this step's forward
    muonclip.zero_grad()

Telemetry (a flat dict the trainer logs as is):

    max_logit               max over layers and heads of S_max^h, before clipping
    max_logit_clipped       min(S_max^h, τ) over heads: the batch's max on the weights it was measured on,
                            after clipping (γ_h scales every logit of a head exactly). The clip scales the
                            weights after this step's Muon update, so the same batch on the final weights
                            differs by what the update moved (the next step's max_logit shows it)
    max_logit/layer{i}      per-layer max over heads
    qk_clipped_heads        heads rescaled this step
    qk_clip_ever_frac       fraction of heads ever clipped (K2 report: 12.7% over its run)
    muon_update_rms         RMS of the shape-scaled orthogonal update r·NS(U) over Muon matrices
    ns_orthogonality_error  ‖O Oᵀ − I‖_F / √rows of NS(momentum) on one sampled matrix (rows ≤ cols)

Max logits are recorded for every optimizer (so AdamW / plain Muon runs show the growth QK-Clip prevents);
only ``name == "muonclip"`` clips.
"""

from __future__ import annotations

import torch

from k2lab.optim import dtensor
from k2lab.optim.grouping import OptimizerConfig, build_optimizer, ns_dtype_request
from k2lab.optim.muon import newton_schulz
from k2lab.optim.qk_clip import QKClip


class MuonClip:
    """The optimizer of a K2 training run: ``step()`` updates, clips and returns telemetry."""

    def __init__(self, model: torch.nn.Module, config: OptimizerConfig, verbose: bool = True) -> None:
        self.config = config
        self.qk_clip = QKClip(model, tau=config.qk_clip_tau, alpha=config.qk_clip_alpha)
        if config.name == "muonclip" and not self.qk_clip.layers:
            raise ValueError(
                f"QK-Clip needs k2lab MultiHeadLatentAttention layers (k2lab.nn.mla), and {type(model).__name__} "
                "has none, so name='muonclip' would clip nothing: use OptimizerConfig(name='muon') (Muon "
                "without QK-Clip) or build the model's attention from k2lab's MLA"
            )
        self.optimizer = build_optimizer(model, config, verbose=verbose)
        self.qk_clip.record(True)
        self.clipping = config.name == "muonclip"
        self._muon_params = [
            p for g in self.optimizer.param_groups if g["kind"] == "muon" for p in g["params"] if p.ndim == 2
        ]
        self._steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> dict[str, float]:
        """Optimizer step, then QK-Clip (if enabled) on the maxima the last forward recorded."""
        maxima = self.qk_clip.recorded_maxima()
        self.optimizer.step()
        clipped = 0
        if self.clipping:
            clipped = self.qk_clip.apply(maxima).clipped_heads
        self._steps += 1
        layers = [
            (i, m) for i, m in zip(self.qk_clip.layer_indices, maxima, strict=True) if m.isfinite().all()
        ]
        measured = [m for _, m in layers]  # a layer no forward ran this step (−∞) has no figure
        stats: dict[str, float] = {
            "max_logit": max((float(m.max()) for m in measured), default=0.0),  # 0 without MLA layers (muon)
            "max_logit_clipped": max(
                (float(m.clamp(max=self.qk_clip.tau).max() if self.clipping else m.max()) for m in measured),
                default=0.0,
            ),
            "qk_clipped_heads": float(clipped),
            "qk_clip_ever_frac": self.qk_clip.ever_clipped_fraction,
            "muon_update_rms": self.optimizer.last_update_rms,
            "ns_orthogonality_error": self._orthogonality_error(),
        }
        stats.update({f"max_logit/layer{i}": float(m.max()) for i, m in layers})
        return stats

    @torch.no_grad()
    def _orthogonality_error(self) -> float:
        """‖O Oᵀ − I‖_F / √rows for O = NS(momentum) of one Muon matrix, a different one each step."""
        if not self._muon_params:
            return 0.0
        param = self._muon_params[self._steps % len(self._muon_params)]
        momentum = self.optimizer.state.get(param, {}).get("momentum_buffer")
        if momentum is None:
            return 0.0
        group = next(g for g in self.optimizer.param_groups if any(p is param for p in g["params"]))
        matrix = dtensor.full(momentum)
        if matrix.shape[0] > matrix.shape[1]:
            matrix = matrix.T
        ortho = newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
        identity = torch.eye(ortho.shape[0], device=ortho.device)
        return float(torch.linalg.matrix_norm(ortho @ ortho.T - identity) / ortho.shape[0] ** 0.5)

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "ever_clipped": [m.clone() for m in self.qk_clip.ever_clipped],
            "steps": self._steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """The saved state, with Newton–Schulz's dtype chosen by this run's ``ns_precision`` on this machine
        (a hardware choice a resumed run may change, ``k2lab.train.resume.RESUMABLE_SETTINGS``)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.request_ns_dtype(ns_dtype_request(self.config.ns_precision))
        self.qk_clip.ever_clipped = [m.clone() for m in state["ever_clipped"]]
        self._steps = state["steps"]
