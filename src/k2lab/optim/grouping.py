"""Which parameter goes to which update rule, by explicit tags (Moonlight / K2 recipe).

The rule is decided by the owning module and the shape first, then by k2lab's names
(``k2lab.optim.routing``), so a researcher's own model routes as well: on k2lab's models

    muon   hidden matrices: attention projections, dense and expert MLP weights ([E, out, in] batched),
           router weight
    adamw  embeddings, lm_head, norms, biases and every other vector (AttnRes pseudo-queries, KDA A_log and
           dt_bias), the KDA short-convolution kernels [C, 1, 4] and the vision patch-embedding convolution and
           position grid (not matrices) (AdamW β = (0.9, 0.95)); the vision tower's linear layers go to Muon
    none   the router's ``e_score_correction_bias`` is a buffer: no gradient, moved by the load balancer

KDA's ``A_log`` and ``dt_bias`` (the forget gate's decay rate and time step) take no weight decay, as the
reference layer marks them (flash-linear-attention's ``KimiDeltaAttention``: ``_no_weight_decay``): decay
would pull the gate's rates towards 0 wherever the gradient does not push back.

With ``per_head_muon`` (K3), the query projection is orthogonalised per head block [q_nope_h; q_rope_h],
the key/value up-projection per head and per part ([k_nope_h], [v_h]), and KDA's q/k/v projections per head.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from rich.console import Console
from rich.table import Table

from k2lab.hardware import DTYPES, Precision
from k2lab.nn.kda import KimiDeltaAttention
from k2lab.nn.mla import MultiHeadLatentAttention
from k2lab.optim.muon import NS_COEFFICIENTS, Muon
from k2lab.optim.routing import ParameterRouter


class OptimizerConfig(BaseModel):
    """Optimizer recipe; ``name`` picks MuonClip (Muon + QK-Clip), plain Muon, or AdamW for everything.
    Every number is finite (an lr of inf passed ``gt=0`` and made every weight NaN)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Literal["muonclip", "muon", "adamw"] = Field(default="muonclip", description="Optimizer.")
    lr: float = Field(default=2e-3, gt=0, description="Peak learning rate.")
    adamw_lr: float | None = Field(default=None, gt=0, description="AdamW-group lr; defaults to lr.")
    weight_decay: float = Field(default=0.1, ge=0)
    momentum: float = Field(default=0.95, ge=0, lt=1)
    nesterov: bool = True
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = Field(default=1e-8, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    ns_steps: int = Field(default=5, gt=0, lt=100)
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    ns_precision: Precision = Field(
        default="auto",
        description="Newton–Schulz dtype: auto = bf16 where the hardware runs it natively (k2lab.hardware).",
    )
    per_head_muon: bool = Field(
        default=False,
        description="K3's Per-Head Muon: Newton–Schulz per head block of the Q/K/V projections (in a "
        "TrainConfig, unset: by the model family, k2lab.train.family_settings).",
    )
    qk_clip_tau: float = Field(default=100.0, gt=0, description="QK-Clip threshold τ.")
    qk_clip_alpha: float = Field(default=0.5, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _legacy_ns_bf16(cls, data: object) -> object:
        """Recipes and checkpoints written before ``ns_precision`` said ``ns_bf16 = true|false``."""
        if isinstance(data, dict) and "ns_bf16" in data:
            data = dict(data)
            legacy = data.pop("ns_bf16")
            if not isinstance(legacy, bool):
                raise ValueError(f"ns_bf16 must be true or false, got {legacy!r}")
            data.setdefault("ns_precision", "bf16" if legacy else "fp32")
        return data


NO_DECAY = ("forget_gate.A_log", "forget_gate.dt_bias")  # KDA's gate parameters (module docstring)


def _head_row_blocks(model: torch.nn.Module) -> dict[int, list[int]]:
    """Per-head row blocks for each attention q / kv up-projection weight, keyed by ``id(weight)``."""
    blocks: dict[int, list[int]] = {}
    for attn in model.modules():
        if isinstance(attn, KimiDeltaAttention):
            for projection in (attn.q_proj, attn.k_proj, attn.v_proj):
                blocks[id(projection.weight)] = [attn.head_dim] * attn.n_heads
        if not isinstance(attn, MultiHeadLatentAttention):
            continue
        query = attn.q_proj.weight if hasattr(attn, "q_proj") else attn.q_up.weight
        blocks[id(query)] = [attn.nope_dim + attn.rope_dim] * attn.n_heads
        blocks[id(attn.kv_up.weight)] = [attn.nope_dim, attn.v_dim] * attn.n_heads
    return blocks


def parameter_groups(model: torch.nn.Module, config: OptimizerConfig) -> list[dict]:
    """Tagged parameter groups (``kind`` muon / adamw) for ``Muon``; unique and complete over trainables."""
    head_blocks = _head_row_blocks(model) if config.per_head_muon else {}
    if config.per_head_muon and config.name != "adamw" and not head_blocks:
        raise ValueError(
            f"per_head_muon=True splits the q/k/v projections of k2lab's MultiHeadLatentAttention and "
            f"KimiDeltaAttention per head, and {type(model).__name__} has neither: set per_head_muon=False"
        )
    router = ParameterRouter(model)
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    names: dict[tuple, list[str]] = defaultdict(list)
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if config.name == "adamw" or router.is_adamw(name, parameter):
            key: tuple = ("adamw", name.endswith(NO_DECAY))
        else:
            key = ("muon", tuple(head_blocks.get(id(parameter), ())))
        buckets[key].append(parameter)
        names[key].append(name)
    adamw_lr = config.adamw_lr or config.lr
    groups = []
    for key, params in buckets.items():
        if key[0] == "adamw":
            groups.append(
                dict(params=params, kind="adamw", lr=adamw_lr, betas=config.betas, adam_eps=config.adam_eps)
            )
            if key[1]:
                groups[-1]["weight_decay"] = 0.0
        else:
            groups.append(dict(params=params, kind="muon", row_blocks=list(key[1]) or None))
        groups[-1]["names"] = names[key]
    return groups


def ns_dtype_request(precision: Precision) -> torch.dtype | None:
    """``Muon``'s ``ns_dtype`` for a config's ``ns_precision``: None for auto (resolved by the optimizer on the
    machine it runs on, again on resume), else the forced dtype."""
    return None if precision == "auto" else DTYPES[precision]


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig, verbose: bool = True) -> Muon:
    """One ``Muon`` optimizer carrying every trainable parameter in tagged groups (see module doc)."""
    groups = parameter_groups(model, config)
    optimizer = Muon(
        groups,
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.momentum,
        nesterov=config.nesterov,
        ns_coefficients=config.ns_coefficients,
        ns_steps=config.ns_steps,
        adjust_lr_fn=config.adjust_lr_fn,
        ns_dtype=ns_dtype_request(config.ns_precision),
    )
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    if verbose:
        print_grouping(optimizer, config)
    return optimizer


def print_grouping(optimizer: Muon, config: OptimizerConfig, console: Console | None = None) -> None:
    """One table: per group the rule, tensor count and parameter total."""
    table = Table(title=f"optimizer: {config.name}")
    for column in ("group", "tensors", "parameters", "lr", "examples"):
        table.add_column(column, justify="right" if column in ("tensors", "parameters", "lr") else "left")
    for group in optimizer.param_groups:
        label = group["kind"] + (" (per-head)" if group.get("row_blocks") else "")
        label += " (no decay)" if group["weight_decay"] == 0 and config.weight_decay else ""
        examples = ", ".join(sorted({n.split(".", 2)[-1] for n in group["names"]})[:3])
        table.add_row(
            label,
            str(len(group["params"])),
            f"{sum(p.numel() for p in group['params']):,}",
            f"{group['lr']:.2e}",
            examples,
        )
    table.caption = "router e_score_correction_bias: no gradient (buffer, moved by the balancer)"
    (console or Console()).print(table)
