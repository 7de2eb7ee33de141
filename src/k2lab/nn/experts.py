"""Routed experts: E gated experts stored as 3-D weights, run once each on their sorted tokens.

Suffixes: N tokens, K picks per token, E experts, D expert input/output width (the model width, or the latent
width in Stable LatentMoE), F expert width.
Dispatch: flatten the (token, pick) pairs, stable-sort them by expert, gather x in that order, run one grouped
matmul per weight (``ops.grouped_mm``), scale each row by its routing weight (fp32) and scatter-add back:

    y_n = Σ_{k} w_{n,k} · W_down[e_{n,k}] act(W_gate[e_{n,k}] x_n, W_up[e_{n,k}] x_n)

On CPU, with enough rows per expert, each expert's group is padded to a multiple of ``GROUP_ROWS`` rows
(repeats of token 0 whose outputs are never read back), so that the products' shapes come from a small set that
oneDNN's primitive cache keeps (``_padded_groups``).
``act`` is SwiGLU ``silu(g) ⊙ u`` by default, or SiTU-GLU (``k2lab.nn.activations``). The sum runs in
``out_dtype`` (default: x's dtype, as K2; fp32 for the latent branch, which normalises the sum next).
No loop over tokens and no compute for unselected experts.

Decode tiers, with fewer (token, pick) rows than experts (a few tokens at a time) and no gradient: the same
products as the grouped tier, without visiting every expert. A compiled CPU step takes the gathered tier up to
``GATHERED_MAX_ROWS`` rows, more rows than experts included (a batch of chats, a speculative verify window).

- eager (``looped_forward``): one pass per picked expert over its rows, with the expert's weights used in
  place (views of the stacked parameters): no weight is copied;
- under ``torch.compile`` (``gathered_forward``): each (token, pick) row applies its expert's weights
  W[e_r] — no data-dependent Python, so one graph serves every step. On CPU as a reduction over the input
  width, ``(W[e_r] * h_r).sum(-1)``, which inductor compiles into one kernel that loads W[e_r] in place (the
  gather is an indexed load, nothing is copied) and streams it at memory speed; elsewhere the weights are
  gathered ([NK, F, D] each) into one batched matmul per weight. In eager mode that gather copies NK·3·F·D
  weights a step, which costs more than the loop's launches (docs/generation.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k2lab.nn.activations import swiglu
from k2lab.nn.decode_linear import decode_linear, stored
from k2lab.ops.grouped_mm import grouped_matmul


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert [E] (int64) of expert ids ``indices`` (any shape): ``bincount`` with a static shape,
    so ``torch.compile`` keeps it in the graph."""
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )


def _row_products(h_RI: torch.Tensor, w_EOI: torch.Tensor, expert_R: torch.Tensor) -> torch.Tensor:
    """h_r W[e_r]ᵀ for every row r: h [R, I], stacked weights [E, O, I], experts [R] -> [R, O], the weights
    cast to h's dtype (as autocast casts them for a matmul). On CPU a reduction over I that reads W[e_r] in
    place; elsewhere one batched matmul over the gathered weights."""
    weight = w_EOI.index_select(0, expert_R).to(h_RI.dtype)
    if h_RI.device.type == "cpu":  # h stored first, as in decode_linear's reduction tier
        return (weight * stored(h_RI).unsqueeze(1)).sum(-1)
    return torch.bmm(h_RI.unsqueeze(1), weight.transpose(1, 2)).squeeze(1)


# Rows of each expert's group rounded up to a multiple of this on CPU (0: off). oneDNN builds and caches one
# primitive per product shape (1,024 of them); a training run's groups take a new row count at nearly every
# step, so without rounding its cache thrashes and rebuilds primitives (≈ 0.7 ms each; docs/performance.md).
GROUP_ROWS = 32
PAD_MIN_GROUPS = 8
# A compiled CPU step (decode, a speculative verify) with up to this many (token, pick) rows takes the gathered
# tier even when the rows outnumber the experts. The grouped tier there multiplies every expert's whole weights,
# which a bf16 twin (k2lab.infer.decode_weights) first widens to fp32 copies. Measured on a Zen 5 (2 threads,
# k2-mini demo model, whole compiled steps, alternating medians of 41, with the reduction tier of
# ``decode_linear.COMPILED_MAX_ROWS``): batch 8 4.55 -> 2.81 ms, batch 16 6.30 -> 3.77 ms, a verify window of
# 4 × 5 tokens 7.84 -> 5.74 ms from this tier alone; 256 rows (batch 128) still 1.17× faster.
GATHERED_MAX_ROWS = 256


def _padded_groups(
    token_of_row: torch.Tensor, counts_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The grouped products' rows with each expert's group padded to a multiple of ``GROUP_ROWS``.

    token_of_row [R] (token of each expert-sorted row), counts_E [E] -> (token of each padded slot [S], slot
    of each sorted row [R], padded counts [E]). A padding slot repeats token 0: its product rows are never read
    back, so their gradient is zero and so is what they add to the weights' gradients and to token 0's.
    Unchanged (and no slots) off CPU, while compiling, with ``GROUP_ROWS`` 0, or for fewer than
    ``PAD_MIN_GROUPS`` · ``GROUP_ROWS`` rows per expert on average (the padding adds at most
    E · (GROUP_ROWS − 1) rows: at most 1/8 more there, half that on average)."""
    rows, experts = len(token_of_row), len(counts_E)
    if (
        not GROUP_ROWS
        or rows < PAD_MIN_GROUPS * GROUP_ROWS * experts
        or token_of_row.device.type != "cpu"
        or torch.compiler.is_compiling()
    ):
        return token_of_row, None, counts_E
    padded_E = (counts_E + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    shift_E = (padded_E.cumsum(0) - padded_E) - (counts_E.cumsum(0) - counts_E)  # padded start − start
    # the sorted rows come expert by expert, counts_E of each
    slot_of_row = torch.arange(rows, device=token_of_row.device) + shift_E.repeat_interleave(
        counts_E, output_size=rows
    )
    token_of_slot = token_of_row.new_zeros(int(padded_E.sum()))
    token_of_slot[slot_of_row] = token_of_row
    return token_of_slot, slot_of_row, padded_E


class RoutedExperts(nn.Module):
    """Weights: gate_EFD, up_EFD [E, F, D] and down_EDF [E, D, F] (``[E, out, in]`` per expert)."""

    def __init__(
        self,
        n_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.activation = activation
        self.gate_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size))

    def forward(
        self,
        x_ND: torch.Tensor,
        indices_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        counts_E: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [N, D], indices/weights [N, K] (``Routing``), optional per-expert counts [E] -> [N, D].

        The weighted rows are summed in ``out_dtype`` (default ``x.dtype``), which is also the result's dtype.
        """
        out_dtype = x_ND.dtype if out_dtype is None else out_dtype
        rows = indices_NK.numel()
        if not torch.is_grad_enabled():
            if torch.compiler.is_compiling() and (
                rows < self.n_experts or (x_ND.device.type == "cpu" and rows <= GATHERED_MAX_ROWS)
            ):
                return self.gathered_forward(x_ND, indices_NK, weights_NK, out_dtype)
            if rows < self.n_experts:
                return self.looped_forward(x_ND, indices_NK, weights_NK, out_dtype)
        top_k = indices_NK.shape[1]
        flat_expert = indices_NK.reshape(-1)
        order = flat_expert.argsort(stable=True)
        token_of_row = order // top_k
        if counts_E is None:
            counts_E = expert_counts(flat_expert, self.n_experts)

        # index_select/index_add_ rather than x[rows]: the backward of advanced indexing
        # (index_put_ with accumulate) is several times slower on CPU.
        token_of_slot, slot_of_row, counts_E = _padded_groups(token_of_row, counts_E)
        x_sorted = x_ND.index_select(0, token_of_slot)
        hidden = self.activation(
            grouped_matmul(x_sorted, self.gate_proj, counts_E),
            grouped_matmul(x_sorted, self.up_proj, counts_E),
        )
        y_sorted = grouped_matmul(hidden, self.down_proj, counts_E)
        if slot_of_row is not None:
            y_sorted = y_sorted.index_select(0, slot_of_row)
        row_weight = weights_NK.reshape(-1).index_select(0, order).unsqueeze(1)
        y_sorted = (y_sorted.float() * row_weight).to(out_dtype)
        return torch.zeros_like(x_ND, dtype=out_dtype).index_add_(0, token_of_row, y_sorted)

    def gathered_forward(
        self, x_ND: torch.Tensor, indices_NK: torch.Tensor, weights_NK: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The compiled decode tier: each (token, pick) row r = (n, k) applies its expert's weights,

            y_n = Σ_k w_{n,k} · W_down[e_r] act(W_gate[e_r] x_n, W_up[e_r] x_n),

        over the NK rows: x [N, D] -> x_r [NK, D], W[e_r] [NK, F, D] -> [N, D] (see the module docstring).

        With at least as many rows as experts the rows go in expert order (a stable sort), so that an expert's
        rows follow each other and its weights, read once from memory, stay in cache for the next ones; the
        results are scatter-added back to their tokens in fp32."""
        N, K = indices_NK.shape
        expert_R, weight_R = indices_NK.reshape(-1), weights_NK.reshape(-1, 1)
        in_expert_order = expert_R.numel() >= self.n_experts
        if in_expert_order:
            order = expert_R.argsort(stable=True)
            expert_R, weight_R, token_R = expert_R[order], weight_R[order], order // K
            x_RD = x_ND.index_select(0, token_R)
        else:  # row r = (n, k): token n's k-th pick
            x_RD = x_ND.repeat_interleave(K, dim=0)
        hidden = self.activation(
            _row_products(x_RD, self.gate_proj, expert_R), _row_products(x_RD, self.up_proj, expert_R)
        )
        y_R = _row_products(hidden, self.down_proj, expert_R).float() * weight_R
        if in_expert_order:
            return y_R.new_zeros(N, y_R.shape[1]).index_add_(0, token_R, y_R).to(out_dtype)
        return y_R.view(N, K, -1).sum(1).to(out_dtype)

    def looped_forward(
        self, x_ND: torch.Tensor, indices_NK: torch.Tensor, weights_NK: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The eager decode tier: for each picked expert e with rows R_e = {(n, k) : e_{n,k} = e},

            y_n += w_{n,k} · W_down[e] act(W_gate[e] x_n, W_up[e] x_n)      for (n, k) ∈ R_e

        with ``W[e]`` a view of the stacked weights. x [N, D] -> [N, D]; the sum runs in fp32."""
        N, K = indices_NK.shape
        rows_of: dict[int, list[int]] = {}
        for row, expert in enumerate(indices_NK.reshape(-1).tolist()):
            rows_of.setdefault(expert, []).append(row)
        weight_R1 = weights_NK.reshape(-1, 1).float()
        y_ND = torch.zeros(N, x_ND.shape[-1], dtype=torch.float32, device=x_ND.device)
        for expert, rows in rows_of.items():
            tokens = [row // K for row in rows]
            if len(rows) == 1:  # one row: slices, no index tensors
                n = tokens[0]
                y = self._expert(expert, x_ND[n : n + 1]).float()
                y_ND[n : n + 1].addcmul_(y, weight_R1[rows[0]])
            else:
                token_index = torch.tensor(tokens, device=x_ND.device)
                y = self._expert(expert, x_ND.index_select(0, token_index)).float()
                y_ND.index_add_(0, token_index, y * weight_R1[rows])
        return y_ND.to(out_dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """W_down[e] act(W_gate[e] x, W_up[e] x) for x [n, D] (weights cast to x's dtype, as autocast does)."""

        def linear(h: torch.Tensor, w: nn.Parameter) -> torch.Tensor:
            weight = w[expert]
            return decode_linear(h, weight if weight.dtype == h.dtype else weight.to(h.dtype))

        return linear(self.activation(linear(x, self.gate_proj), linear(x, self.up_proj)), self.down_proj)

    def extra_repr(self) -> str:
        E, F, D = self.gate_proj.shape
        return f"{E} experts, {D} -> {F} -> {D}, activation={getattr(self.activation, '__name__', self.activation)}"
