"""Parameter accounting on the meta device: total, active per token, and a per-component breakdown.

total  = every tensor a checkpoint stores (parameters and persistent buffers such as the router's
         ``e_score_correction_bias``; this is how the public 1,026,408,232,448 for K2 is counted)
active = total − (n_routed_experts − num_experts_per_tok) · (one expert) · (MoE layers)
         i.e. everything except the routed experts a token does not select.

Multi-token-prediction modules (``num_nextn_predict_layers``) are one component, ``mtp`` (their norms,
``eh_proj`` and block; an MoE block's unselected experts leave ``active`` like a main layer's). They share
the embedding and head, so the per-layer copies of both that DeepSeek-V3 checkpoints store (and ``to_hf``
writes, ``k2lab.hf.mtp``) are not counted again. Every preset keeps its public config's MTP setting: none
(K2 released without MTP; DeepSeek-V3's 671B is without it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k2lab.config import ModelConfig
from k2lab.errors import K2LabError
from k2lab.models import build_model

# What the papers / model cards report, shown beside our exact counts (source in the note).
PUBLISHED: dict[str, dict[str, object]] = {
    "k2": {"total": 1.04e12, "active": 32.6e9, "note": "Kimi K2 report: 1.04T total / 32.6B activated"},
    "k3": {
        "total": 2.78e12,
        "active": 104.2e9,
        "note": "Kimi K3 report: 2.78T total / 104.2B activated. Gap: the report does not publish K3's "
        "KDA heads, MLA kv_lora / v width or vocabulary; we assume K2's (96×128, 512, 128, 163,840). "
        "Our active 105.36B counts both 1.17B vocabulary tables (embedding and output head); without the "
        "input embedding (a lookup) it is 104.19B, the report's figure; without both, 103.02B",
    },
    "kimi-linear-48b-a3b": {
        "total": 48e9,
        "active": 3e9,
        "note": "Kimi Linear model card: 48B total / 3B activated (names rounded; the checkpoint "
        "holds 49.1B)",
    },
    "deepseek-v3": {"total": 671e9, "active": 37e9, "note": "DeepSeek-V3 report: 671B total / 37B activated"},
    "moonlight-16b-a3b": {
        "total_excl_embeddings": 15.29e9,
        "active_excl_embeddings": 2.24e9,
        "note": "Moonlight README: 15.29B total / 2.24B activated, without embeddings",
    },
}

COMPONENTS = (
    "embedding",
    "lm_head",
    "attention",
    "attnres",
    "dense_mlp",
    "router",
    "routed_experts",
    "shared_experts",
    "latent_projection",
    "norms",
    "mtp",
)


@dataclass
class ParamReport:
    preset: str
    total: int
    active: int
    embedding_params: int
    components: dict[str, int] = field(default_factory=dict)
    per_expert: int = 0
    moe_layers: int = 0

    @property
    def total_excl_embeddings(self) -> int:
        return self.total - self.embedding_params

    @property
    def active_excl_embeddings(self) -> int:
        return self.active - self.embedding_params

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "preset": self.preset,
            "total": self.total,
            "active": self.active,
            "total_excl_embeddings": self.total_excl_embeddings,
            "active_excl_embeddings": self.active_excl_embeddings,
            "per_expert": self.per_expert,
            "moe_layers": self.moe_layers,
            "components": dict(self.components),
        }
        if self.preset in PUBLISHED:
            data["published"] = PUBLISHED[self.preset]
        return data


def _component_of(name: str) -> str:
    if name.startswith("mtp."):  # multi-token-prediction modules, block included
        return "mtp"
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".attn." in name:  # MLA or KDA; includes the latent norms, as the per-layer 101,124,096 does
        return "attention"
    if "_res." in name:  # Block AttnRes pseudo-queries and key norms
        return "attnres"
    if ".mlp.latent_" in name:  # Stable LatentMoE down/up projections and latent norm
        return "latent_projection"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    return "norms"


def count_parameters(config: ModelConfig) -> ParamReport:
    """Build ``config`` on the meta device (no memory) and count what a checkpoint of it stores."""
    model = build_model(config, device="meta")
    components = dict.fromkeys(COMPONENTS, 0)
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied embeddings are stored once
            continue
        seen.add(id(tensor))
        components[_component_of(name)] += tensor.numel()
    total = sum(components.values())

    moe_layers = model.moe_layers()
    per_expert = 0
    if moe_layers:
        experts = moe_layers[0].experts
        per_expert = sum(w[0].numel() for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    unselected = config.n_routed_experts - config.num_experts_per_tok
    active = total - unselected * per_expert * len(moe_layers)
    embedding_params = components["embedding"] + components["lm_head"]
    return ParamReport(
        preset=config.name,
        total=total,
        active=active,
        embedding_params=embedding_params,
        components=components,
        per_expert=per_expert,
        moe_layers=len(moe_layers),
    )


def humanize(count: float) -> str:
    """1_026_408_232_448 -> '1.03T'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.2f}{unit}"
    return str(int(count))


def available_memory() -> int | None:
    """Bytes of memory the OS reports available (``MemAvailable`` of /proc/meminfo), or None where unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_in_memory(config: ModelConfig, what: str, copies: int = 1, name: str | None = None) -> None:
    """Refuse (``K2LabError``) to build ``config`` for ``what`` where ``copies`` fp32 copies of its parameters
    (weights, gradients, optimizer state) exceed the memory available: ``k2lab train --preset k2`` tried to
    allocate terabytes and ended in the allocator's traceback. ``name``: what the user asked for (a
    vision-language preset whose language model ``config`` is), by default ``config.name``."""
    total = count_parameters(config).total
    need, available = 4 * copies * total, available_memory()
    if available is not None and need > available:
        shown = config.name or "this model"
        shown = f"{name} (language model {shown})" if name and name != config.name else shown
        raise K2LabError(
            f"{shown} has {humanize(total)} parameters: {what} needs about "
            f"{need / 1e9:,.1f} GB ({copies} fp32 cop{'y' if copies == 1 else 'ies'}) and this machine has "
            f"{available / 1e9:,.1f} GB available; the mini presets train on a CPU (`k2lab presets`)"
        )
