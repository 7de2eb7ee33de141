"""Optimizers: Muon (batched over experts, Per-Head option), QK-Clip, MuonClip with telemetry."""

from k2lab.optim.grouping import OptimizerConfig, build_optimizer, parameter_groups
from k2lab.optim.muon import Muon, newton_schulz
from k2lab.optim.muonclip import MuonClip
from k2lab.optim.qk_clip import QKClip, clip_head_weights

__all__ = [
    "Muon",
    "MuonClip",
    "OptimizerConfig",
    "QKClip",
    "build_optimizer",
    "clip_head_weights",
    "newton_schulz",
    "parameter_groups",
]
