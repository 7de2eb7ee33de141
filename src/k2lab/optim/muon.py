"""Muon: momentum orthogonalised by a Newton–Schulz quintic, for hidden weight matrices.

For a matrix parameter W with gradient G (Keller Jordan's Muon; Moonlight's scaling; torch.optim.Muon's API):

    B ← μ·B + (1 − μ)·G                       (momentum buffer, EMA form as in torch.optim.Muon)
    U ← (1 − μ)·G + μ·B  if nesterov else B
    O ← NS5(U):  X ← U / max(‖U‖_F, eps), transposed so rows ≤ cols;
                 5 × { A = X Xᵀ;  X ← a X + (b A + c A²) X },  (a, b, c) = (3.4445, −4.7750, 2.0315)
    W ← W · (1 − lr·wd)                        (decoupled weight decay with the unadjusted lr)
    W ← W − lr·r(A, B)·O,  r = sqrt(max(1, A/B)) ("original") or 0.2·sqrt(max(A, B)) ("match_rms_adamw")

3-D expert weights [E, out, in] are orthogonalised per expert in one batched Newton–Schulz. With
``row_blocks`` set on a parameter group (Per-Head Muon, K3), the rows of each matrix are cut into blocks
(one per head, e.g. [q_nope_h; q_rope_h]) and each block is orthogonalised on its own; blocks of one size
run as one batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from k2lab.hardware import choose

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Approximate orthogonalisation of [..., A, B] matrices (batched over leading dims), in ``dtype``."""
    if update.ndim < 2:
        raise ValueError(f"Newton–Schulz needs matrices, got shape {tuple(update.shape)}")
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])  # [N, A, B]: one batch for every leading index
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) if x.shape[0] > 1 else x.norm()
    x = x / norm.clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A², fused as torch.optim.Muon
        x = torch.baddbmm(x, poly, x, beta=a)  # a·X + (b·A + c·A²)·X
    x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if tall else x


def lr_ratio(adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Shape-dependent lr multiplier for one matrix [rows, cols]."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {adjust_lr_fn!r}")


def orthogonalize(
    update: torch.Tensor,
    row_blocks: Sequence[int] | None,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """NS of update [..., rows, cols], whole or per row block; returns O and (start, rows, cols) per block."""
    rows, cols = update.shape[-2:]
    if not row_blocks:
        return newton_schulz(update, coefficients, steps, eps, dtype), [(0, rows, cols)]
    if sum(row_blocks) != rows:
        raise ValueError(f"row_blocks {list(row_blocks)} do not add up to the {rows} rows of the matrix")
    starts = [sum(row_blocks[:i]) for i in range(len(row_blocks))]
    out = torch.empty_like(update, dtype=dtype)
    for size in sorted(set(row_blocks)):
        chosen = [start for start, block in zip(starts, row_blocks, strict=True) if block == size]
        stacked = torch.stack([update[..., s : s + size, :] for s in chosen], dim=-3)
        result = newton_schulz(stacked, coefficients, steps, eps, dtype)
        for i, s in enumerate(chosen):
            out[..., s : s + size, :] = result[..., i, :, :]
    return out, [(s, block, cols) for s, block in zip(starts, row_blocks, strict=True)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a (possibly FSDP2-sharded) tensor: Newton–Schulz must see every row."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _like(full: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Re-shard ``full`` the way ``reference`` is sharded (each rank keeps its own slice, no communication)."""
    if isinstance(reference, DTensor):
        return distribute_tensor(full, reference.device_mesh, reference.placements, src_data_rank=None)
    return full


def _global_rms(square_sum: float, count: int) -> float:
    """RMS over every rank's shard of the updates (plain RMS without a process group)."""
    if dist.is_available() and dist.is_initialized():
        totals = torch.tensor([square_sum, float(count)], dtype=torch.float64)
        dist.all_reduce(totals)
        square_sum, count = float(totals[0]), int(totals[1])
    return math.sqrt(square_sum / max(count, 1))


class Muon(Optimizer):
    """Drop-in for ``torch.optim.Muon`` that also takes 3-D expert weights and AdamW groups.

    Beyond torch.optim.Muon's arguments: ``ns_dtype`` (``None``: what ``k2lab.hardware.choose`` picks for
    Newton–Schulz — bf16 where the device multiplies bf16 natively, as torch.optim.Muon always does, which
    it then reproduces to fp32 rounding; fp32 where bf16 would be emulated, ~250× slower on AVX2-only
    CPUs, and a more exact orthogonalisation), and per parameter group
    ``row_blocks`` (Per-Head Muon: list of row-block sizes) and ``kind="adamw"`` (with ``betas``,
    ``adam_eps``) for the parameters Muon should not touch (embeddings, head, norms, biases), so one
    optimizer object carries every parameter, one state dict and one lr schedule.
    FSDP2 (DTensor) parameters are orthogonalised on the full matrix and the result re-sharded.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"invalid Muon hyper-parameters: lr={lr}, weight_decay={weight_decay}, momentum={momentum}"
            )
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
        lr_ratio(adjust_lr_fn, 1, 1)  # validates the name
        defaults = dict(
            kind="muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype or choose("newton_schulz").dtype,
            row_blocks=None,
            betas=(0.9, 0.95),
            adam_eps=1e-8,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["kind"] not in ("muon", "adamw"):
                raise ValueError(f"parameter group kind must be 'muon' or 'adamw', got {group['kind']!r}")
            for p in group["params"]:
                if group["kind"] == "muon" and p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon takes 2-D matrices or 3-D [E, out, in] experts, got shape {tuple(p.shape)}; "
                        "put it in a kind='adamw' group"
                    )
        self.last_update_rms: float = 0.0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        square_sum, count = 0.0, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["kind"] == "adamw":
                    self._adamw_step(p, group)
                    continue
                scaled = self._muon_update(p, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(scaled, alpha=-group["lr"])
                local = scaled.to_local() if isinstance(scaled, DTensor) else scaled
                square_sum += float(torch.linalg.vector_norm(local, dtype=torch.float32)) ** 2
                count += local.numel()
        self.last_update_rms = _global_rms(square_sum, count)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The shape-scaled orthogonalised momentum r·NS(U), sharded like ``p`` (lr not applied)."""
        momentum = self._momentum_update(p, group)
        ortho, blocks = orthogonalize(
            _full(momentum),
            group["row_blocks"],
            group["ns_coefficients"],
            group["ns_steps"],
            group["eps"],
            group["ns_dtype"],
        )
        ortho = ortho.to(p.dtype)
        for start, rows, cols in blocks:
            ortho[..., start : start + rows, :] *= lr_ratio(group["adjust_lr_fn"], rows, cols)
        return _like(ortho, p)

    def _momentum_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(p.grad, 1 - group["momentum"])
        return p.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _adamw_step(self, p: torch.Tensor, group: dict) -> None:
        """AdamW: m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²; p ← p(1 − lr·wd) − lr·m̂/(√v̂ + eps)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = state["step"]
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denominator = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(group["adam_eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1**step))
