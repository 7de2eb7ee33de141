"""Muon: momentum orthogonalised by a Newton–Schulz quintic, for hidden weight matrices.

For a matrix parameter W with gradient G (Keller Jordan's Muon; Moonlight's scaling; torch.optim.Muon's API):

    B ← μ·B + (1 − μ)·G                       (momentum buffer, EMA form as in torch.optim.Muon)
    U ← (1 − μ)·G + μ·B  if nesterov else B
    O ← NS5(U):  X ← U / max(‖U‖_F, eps), transposed so rows ≤ cols;
                 5 × { A = X Xᵀ;  X ← a X + (b A + c A²) X },  (a, b, c) = (3.4445, −4.7750, 2.0315)
    W ← W · (1 − lr·wd)                        (decoupled weight decay with the unadjusted lr)
    W ← W − lr·r(A, B)·O,  r = sqrt(max(1, A/B)) ("original") or 0.2·sqrt(max(A, B)) ("match_rms_adamw")

r·O is formed in fp32 or wider (``update_dtype``: a bf16 or fp16 parameter's too) and rounded into W's dtype
once, by the subtraction: a bf16 W becomes W − lr·r·O correctly rounded. (torch.optim.Muon's bf16
``param.add_(O, alpha=-lr·r)`` rounds the scalar lr·r to bf16 first, so ~0.4% of its entries land 1 ulp off.)

3-D expert weights [E, out, in] are orthogonalised per expert in one batched Newton–Schulz. With
``row_blocks`` set on a parameter group (Per-Head Muon, K3), the rows of each matrix are cut into blocks
(one per head, e.g. [q_nope_h; q_rope_h]) and each block is orthogonalised on its own; blocks of one size
run as one batch. Plain 2-D matrices of one shape share a batch as well (up to ``MAX_BATCH``, sides over 16),
and every batch runs in buffers the optimizer keeps (``Workspace``): U is written straight into its slice,
so a step allocates next to nothing. The arithmetic is torch.optim.Muon's, matrix by matrix.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from k2lab.optim import dtensor
from k2lab.optim.dynamo_free import WithoutDynamoImport
from k2lab.optim.muon_groups import resolve_ns_dtype, setup_group, validate_hyperparameters, with_grads

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MAX_BATCH = 16  # 2-D matrices per batched Newton–Schulz (an expert tensor's count; 240 ran slower)
MKLDNN_MIN_SIZE = 16**3  # torch's checksize: a product whose m·k·n (× batch) exceeds this goes to oneDNN


class Workspace:
    """Reused buffers of the Newton–Schulz iteration, one per (name, shape, dtype, device).

    A step orthogonalises the same shapes every time; allocating X, A = X Xᵀ, b·A + c·A² and the next X
    afresh each iteration first-touches new pages (a page fault plus zeroing per 4 KiB, costly on a KVM
    guest, see docs/performance.md "Freed memory kept mapped"), so the optimizer keeps one of each.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, tuple(shape), dtype, device)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return self._buffers[key]


def iterate_newton_schulz(
    x: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    workspace: Workspace,
) -> torch.Tensor:
    """NS5 of x [N, A, B] (A ≤ B, any strides), overwriting x; the result is x or a workspace buffer.

    X ← X / max(‖X‖_F, eps) per matrix, then ``steps`` × { A = X Xᵀ;  X ← a X + (b A + c A²) X } as
    ``bmm`` + two ``baddbmm`` (torch.optim.Muon's addmm calls, batched) into reused outputs.
    """
    a, b, c = coefficients
    n, rows, cols = x.shape
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) if n > 1 else x.norm()
    x.div_(norm.clamp(min=eps))
    gram = workspace.get("gram", (n, rows, rows), x.dtype, x.device)
    poly = workspace.get("poly", (n, rows, rows), x.dtype, x.device)
    spare = workspace.get("x1", (n, rows, cols), x.dtype, x.device)
    other = x if x.is_contiguous() else workspace.get("x2", (n, rows, cols), x.dtype, x.device)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=poly)  # b·A + c·A², fused as torch.optim.Muon
        torch.baddbmm(x, poly, x, beta=a, out=spare)  # a·X + (b·A + c·A²)·X
        x, spare, other = spare, other, spare
    return x


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.float32,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Approximate orthogonalisation of [..., A, B] matrices (batched over leading dims), in ``dtype``.

    With a ``workspace`` the result lives in its buffers (valid until the next call with the same shapes).
    """
    if update.ndim < 2:
        raise ValueError(f"Newton–Schulz needs matrices, got shape {tuple(update.shape)}")
    workspace = workspace or Workspace()
    rows, cols = update.shape[-2:]
    x = workspace.get("input", (update[..., 0, 0].numel(), rows, cols), dtype, update.device)
    x.copy_(update.reshape(x.shape))
    tall = rows > cols
    result = iterate_newton_schulz(x.mT if tall else x, coefficients, steps, eps, workspace)
    result = result.mT if tall else result
    return result.reshape(update.shape)


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
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """NS of update [..., rows, cols], whole or per row block; returns O and (start, rows, cols) per block."""
    rows, cols = update.shape[-2:]
    if not row_blocks:
        return newton_schulz(update, coefficients, steps, eps, dtype, workspace), [(0, rows, cols)]
    if sum(row_blocks) != rows:
        raise ValueError(f"row_blocks {list(row_blocks)} do not add up to the {rows} rows of the matrix")
    starts = [sum(row_blocks[:i]) for i in range(len(row_blocks))]
    out = torch.empty_like(update, dtype=dtype)
    for size in sorted(set(row_blocks)):
        chosen = [start for start, block in zip(starts, row_blocks, strict=True) if block == size]
        stacked = torch.stack([update[..., s : s + size, :] for s in chosen], dim=-3)
        result = newton_schulz(stacked, coefficients, steps, eps, dtype, workspace)
        for i, s in enumerate(chosen):
            out[..., s : s + size, :] = result[..., i, :, :]
    return out, [(s, block, cols) for s, block in zip(starts, row_blocks, strict=True)]


def same_shape_batches(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """2-D parameters of one shape, dtype and device in batches of ≤ ``MAX_BATCH``; each 3-D one alone.

    Only matrices whose smaller side is over 16 are batched: torch sends a product to oneDNN when
    m·k·n (times the batch) exceeds 16³, so a batch of 16 × 16 products would take another kernel (another
    rounding) than torch.optim.Muon's ``addmm`` on each; above that both take oneDNN's.
    """
    batches: list[list[torch.Tensor]] = []
    filling: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        key = (tuple(p.shape), p.dtype, p.device)
        alone = p.ndim == 3 or min(p.shape) ** 3 <= MKLDNN_MIN_SIZE
        if alone or key not in filling or len(filling[key]) == MAX_BATCH:
            batches.append([])
            filling[key] = batches[-1]
        filling[key].append(p)
    return batches


def _square_sum(tensor: torch.Tensor) -> float:
    """Σ x² over a tensor [..., cols]: fp32 norms of its rows, summed in fp64 (one fp32 sum over millions of
    entries drifts by ~1e-4 relative)."""
    return float(torch.linalg.vector_norm(tensor, dim=-1, dtype=torch.float32).double().square().sum())


def newton_schulz_flops(batch: list[torch.Tensor]) -> int:
    """Multiply-add FLOPs of one NS iteration of a batch: n · (2·A·A·B + 2·A³ + 2·A·A·B), A ≤ B."""
    rows, cols = batch[0].shape[-2:]
    small, large = min(rows, cols), max(rows, cols)
    return sum(p[..., 0, 0].numel() for p in batch) * (4 * small * small * large + 2 * small**3)


def balanced_shares(batches: list[list[torch.Tensor]], workers: int) -> list[list[list[torch.Tensor]]]:
    """Batches dealt to ``workers``, largest first, each to the least loaded (by ``newton_schulz_flops``)."""
    shares: list[list[list[torch.Tensor]]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for batch in sorted(batches, key=newton_schulz_flops, reverse=True):
        least = loads.index(min(loads))
        shares[least].append(batch)
        loads[least] += newton_schulz_flops(batch)
    return shares


def update_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype r·O is formed in for a parameter of ``dtype``: fp32 or wider, so that a bf16 / fp16 W is
    rounded once, by the subtraction (r·O rounded to bf16 first put ~1.3% of a bf16 W's entries 1 ulp off)."""
    return torch.promote_types(dtype, torch.float32)


def _apply(p: torch.Tensor, scaled: torch.Tensor, group: dict) -> None:
    """W ← W·(1 − lr·wd) − lr·(r·O), in place (the batched and the per-tensor path alike); ``scaled`` is in
    ``update_dtype(W.dtype)``, so the subtraction is computed in it and rounded to W's dtype once."""
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(scaled, alpha=-group["lr"])


def _global_rms(square_sum: float, count: int) -> float:
    """RMS over every rank's shard of the updates (plain RMS without a process group)."""
    if dist.is_available() and dist.is_initialized():
        totals = torch.tensor([square_sum, float(count)], dtype=torch.float64)
        dist.all_reduce(totals)
        square_sum, count = float(totals[0]), int(totals[1])
    return math.sqrt(square_sum / max(count, 1))


class Muon(WithoutDynamoImport, Optimizer):
    """Drop-in for ``torch.optim.Muon`` that also takes 3-D expert weights and AdamW groups.

    Beyond torch.optim.Muon's arguments: ``ns_dtype`` (``None``: what ``k2lab.hardware.choose`` picks for
    Newton–Schulz — bf16 where the device multiplies bf16 natively, as torch.optim.Muon always does, which
    it then reproduces to fp32 rounding; fp32 where bf16 would be emulated, ~250× slower on AVX2-only
    CPUs, and a more exact orthogonalisation; a dtype forces it), and per parameter group
    ``row_blocks`` (Per-Head Muon: list of row-block sizes) and ``kind="adamw"`` (with ``betas``,
    ``adam_eps``) for the parameters Muon should not touch (embeddings, head, norms, biases), so one
    optimizer object carries every parameter, one state dict and one lr schedule.
    FSDP2 (DTensor) parameters are orthogonalised on the full matrix and the result re-sharded.

    A group's ``ns_dtype`` is the dtype Newton–Schulz runs in here; ``state_dict`` saves the request instead
    (None for auto, or the forced dtype), so ``load_state_dict`` on another machine picks that machine's
    dtype (a checkpoint of an AMX machine resumed on an AVX2-only one runs fp32, not its ~250× slower bf16).
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
            ns_dtype=ns_dtype,  # None: what k2lab.hardware picks for the group's device (below)
            row_blocks=None,
            betas=(0.9, 0.95),
            adam_eps=1e-8,
        )
        validate_hyperparameters(defaults)
        self._muon_defaults = dict(defaults)  # torch adds keys of its own (differentiable) to self.defaults
        super().__init__(params, defaults)  # each group through add_param_group: checked, ns_dtype resolved
        self.last_update_rms: float = 0.0
        self._workspace = Workspace()
        self._workspaces: list[Workspace] = []  # one per worker of _run_batches

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group`` (defaults filled in), then the group's checks and ``ns_dtype``
        (``k2lab.optim.muon_groups``): the constructor's groups take this path too."""
        super().add_param_group(param_group)
        try:
            setup_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def state_dict(self) -> dict:
        """torch's ``state_dict`` with each group's ``ns_dtype`` the request (None: auto), not this machine's
        resolved dtype: what the user asked for travels with the state, the hardware's answer does not."""
        state = super().state_dict()
        for saved, group in zip(state["param_groups"], self.param_groups, strict=True):
            saved["ns_dtype"] = saved.pop("ns_dtype_request", group["ns_dtype"])
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, then every group key the saved state lacks (a torch.optim.Muon
        state has no ``kind``, ``row_blocks``, ``ns_dtype``, ...) from the defaults, set up as a new group's:
        the saved ``ns_dtype`` request is resolved on this machine (a forced dtype stays forced; a state saved
        before requests were kept holds the saving machine's resolved dtype, taken as forced)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key, value in self._muon_defaults.items():
                group.setdefault(key, value)
            setup_group(group)

    def request_ns_dtype(self, request: torch.dtype | None) -> None:
        """Every group's Newton–Schulz dtype asked for anew (None: auto, resolved on this machine), e.g. a
        resumed run's own setting over the one its checkpoint saved."""
        for group in self.param_groups:
            resolve_ns_dtype(group, request)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        square_sum, count = 0.0, 0
        for group in self.param_groups:
            params = with_grads(group)
            if group["kind"] == "adamw":
                for p in params:
                    self._adamw_step(p, group)
                continue
            self._advance_momentum(params, group)
            plain = [] if group["row_blocks"] else [p for p in params if not dtensor.is_dtensor(p)]
            for batch_squares, batch_count in self._run_batches(same_shape_batches(plain), group):
                square_sum, count = square_sum + batch_squares, count + batch_count
            batched = {id(p) for p in plain}
            for p in params:
                if id(p) not in batched:
                    scaled = self._muon_update(p, group)
                    _apply(p, scaled, group)
                    local = scaled.to_local() if dtensor.is_dtensor(scaled) else scaled
                    square_sum += _square_sum(local)
                    count += local.numel()
        self.last_update_rms = _global_rms(square_sum, count)
        return loss

    def _run_batches(self, batches: list[list[torch.Tensor]], group: dict) -> list[tuple[float, int]]:
        """``_batched_update`` of every batch; with T > 1 intra-op threads (CPU), T Python workers of one
        thread each take a balanced share of the batches.

        A T-thread op ends when its slowest thread does, and on a shared machine one is often descheduled:
        workers that never wait on each other keep both cores busy (a [16, 256, 256] bmm pair: 116 ms
        against 210 ms as one 2-thread call under load). oneDNN's matrix products do not depend on the thread
        count (the updates are bit-identical to the serial path's: tests); reductions in general may.
        """
        threads = torch.get_num_threads()
        if threads < 2 or len(batches) < 2 or any(b[0].device.type != "cpu" for b in batches):
            return [self._batched_update(batch, group, self._workspace) for batch in batches]
        while len(self._workspaces) < threads:
            self._workspaces.append(Workspace())
        shares = [share for share in balanced_shares(batches, threads) if share]
        try:
            with ThreadPoolExecutor(len(shares)) as pool:
                futures = [
                    pool.submit(self._work, share, group, workspace)
                    for share, workspace in zip(shares, self._workspaces, strict=False)
                ]
                return [result for future in futures for result in future.result()]
        finally:  # torch's count is process-wide: back to the caller's once every worker is done
            torch.set_num_threads(threads)

    def _work(
        self, share: list[list[torch.Tensor]], group: dict, workspace: Workspace
    ) -> list[tuple[float, int]]:
        """One worker's batches, on one intra-op thread (grad mode is per thread: off here as in ``step``).

        ``get_num_threads`` first: a thread takes torch's process-wide count at its first parallel call, which
        would otherwise come after ``set_num_threads(1)`` and could read another worker's value."""
        torch.get_num_threads()
        torch.set_num_threads(1)
        with torch.no_grad():
            return [self._batched_update(batch, group, workspace) for batch in share]

    def _batched_update(
        self, batch: list[torch.Tensor], group: dict, workspace: Workspace
    ) -> tuple[float, int]:
        """W ← W·(1 − lr·wd) − lr·r·NS(U) for same-shape plain tensors in one batched Newton–Schulz.

        Each U [(E,) rows, cols] is written into its slice of one reused [n, rows, cols] batch (n matrices in
        all; U in W's dtype, as torch computes it), cast to ``ns_dtype`` for NS, and W is updated from its
        slice of r·O (in ``update_dtype``, the same arithmetic as the per-tensor path). Returns
        (Σ (r·O)², count) for ``last_update_rms``.
        """
        rows, cols = batch[0].shape[-2:]
        counts = [p[..., 0, 0].numel() for p in batch]  # matrices per tensor: 1, or E for [E, out, in]
        starts = [sum(counts[:i]) for i in range(len(batch))]
        shape, device = (sum(counts), rows, cols), batch[0].device
        x = workspace.get("input", shape, group["ns_dtype"], device)
        wide = workspace.get("wide", shape, batch[0].dtype, device)  # U in W's dtype (then r·O if fp32)
        for p, start, n in zip(batch, starts, counts, strict=True):
            self._momentum_update(p, group, out=wide[start : start + n].view(p.shape))
        x.copy_(wide)  # a cast into an out= of another dtype would allocate a temporary per call
        tall = rows > cols
        ortho = iterate_newton_schulz(
            x.mT if tall else x, group["ns_coefficients"], group["ns_steps"], group["eps"], workspace
        )
        wider = update_dtype(wide.dtype)
        scaled = wide if wide.dtype == wider else workspace.get("scaled", shape, wider, device)
        scaled.copy_(ortho.mT if tall else ortho).mul_(lr_ratio(group["adjust_lr_fn"], rows, cols))
        for p, start, n in zip(batch, starts, counts, strict=True):
            _apply(p, scaled[start : start + n].view(p.shape), group)
        return _square_sum(scaled), scaled.numel()

    def _muon_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """The shape-scaled orthogonalised momentum r·NS(U), sharded like ``p`` (lr not applied)."""
        ortho, blocks = orthogonalize(
            dtensor.full(self._momentum_update(p, group)),
            group["row_blocks"],
            group["ns_coefficients"],
            group["ns_steps"],
            group["eps"],
            group["ns_dtype"],
            self._workspace,
        )
        ortho = ortho.to(update_dtype(p.dtype))
        for start, rows, cols in blocks:
            ortho[..., start : start + rows, :] *= lr_ratio(group["adjust_lr_fn"], rows, cols)
        return dtensor.like(ortho, p)

    def _advance_momentum(self, params: list[torch.Tensor], group: dict) -> None:
        """B ← μ·B + (1 − μ)·G for every parameter of the group (one foreach call for plain tensors)."""
        buffers = []
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            buffers.append(self.state[p]["momentum_buffer"])
        plain = [i for i, p in enumerate(params) if not dtensor.is_dtensor(p)]
        if plain:
            torch._foreach_lerp_(
                [buffers[i] for i in plain], [params[i].grad for i in plain], 1 - group["momentum"]
            )
        for i, p in enumerate(params):
            if dtensor.is_dtensor(p):
                buffers[i].lerp_(p.grad, 1 - group["momentum"])

    def _momentum_update(self, p: torch.Tensor, group: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """U = (1 − μ)·G + μ·B (Nesterov) or B, written into ``out`` (cast to its dtype) when given."""
        buffer = self.state[p]["momentum_buffer"]
        if not group["nesterov"]:
            return buffer if out is None else out.copy_(buffer)
        return torch.lerp(p.grad, buffer, group["momentum"], out=out)

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
