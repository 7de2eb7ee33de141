"""Kimi Delta Attention layer (Kimi Linear, K3): a gated delta rule with per-channel decay.

Per token x [D], head h (H heads of width K):

    [q; k; v] = SiLU(CausalDepthwiseConv_4([W_q x; W_k x; W_v x]))        short convolution, kernel 4
    q, k ← q / sqrt(Σq² + 1e-6), k / sqrt(Σk² + 1e-6)                     L2 norm per head
    g = ForgetGate(x) [H, K] (``kda_gate``),  β = sigmoid(W_β x) [H]
    S_t = (I − β_t k_t k_tᵀ) Diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ,   o_t = (K^-0.5 q_t)ᵀ S_t   (``ops.kda``)
    y = W_O [RMSNorm(o^h) · w · sigmoid(G^h x)]_h                          gated output norm
        G low rank (D -> K -> H·K) in Kimi Linear, full rank (D -> H·K) in K3

Decoding keeps per sequence only the recurrent state S [H, K, K] (fp32) and the last ``kernel − 1``
projected inputs of the convolution [3·H·K, kernel − 1]: memory is constant in the context length.
A cache view with ``record_steps`` (``StepRecorder``) gets the states after every token of the window
instead (speculative decoding's verify step, which then keeps those after the last accepted token).
Padding tokens (``valid`` False) leave the layer's state as if they were absent, wherever they sit (left
padding after cached tokens, right padding, holes): they are zeroed before the projections, their g and β
are set to 0 (S_t = S_{t−1}: no decay, no write), and the short convolution runs over the real inputs only
(``nn.kda_padding``), so each real token's window holds the previous real inputs and the conv state the last
kernel − 1 real ones. A pad's own output is arbitrary (MLA masks pad keys; a KDA layer skips them).

As in the released code (mlx-lm / vLLM ``kimi_k3``, checked by tests/hf/test_kimi_k3_mlx.py): the SiLU follows the
convolution of each of q, k, v (``{q,k,v}_conv1d`` [C, 1, W] in the checkpoint); the L2 norm adds its 1e-6 to
Σx² (not to the mean); the K^-0.5 read-out scale multiplies the normalised q; the output norm's ε is
``rms_norm_eps`` (1e-5 in K3) with its weight, and the gate is sigmoid(W_g x) of the layer input x (full rank
[H·K, D], ``g_proj``, in K3). The report writes o_t = S_tᵀ q_t; the code scales q by K^-0.5 first.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from k2lab.config import ModelConfig
from k2lab.nn.decode_linear import decode_linear
from k2lab.nn.kda_gate import ForgetGate
from k2lab.nn.kda_padding import compact_real, padded_short_conv, real_history
from k2lab.nn.norm import GatedRMSNorm
from k2lab.ops.kda import kda, recurrent_kda_states


class RecurrentState(Protocol):
    """The per-layer view of a decode cache for a KDA layer."""

    conv: torch.Tensor  # [B, 3·H·K, kernel − 1]
    recurrent: torch.Tensor  # [B, H, K, K] fp32

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None: ...


class StepRecorder(RecurrentState, Protocol):
    """A cache view that asks for the state after every token of the window (``record_steps`` True):
    speculative decoding verifies a few drafted tokens at once and continues from the state after the last
    accepted one. The layer then runs the recurrence token by token (``ops.kda.recurrent_kda_states``)."""

    record_steps: bool

    def update_steps(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """conv [B, T, 3·H·K, kernel − 1] and recurrent [B, T, H, K, K] fp32: the states after each token."""
        ...


# Log-decay that empties the state at a packed document's first token: the old state keeps a weight of at
# most exp(−30) ≈ 1e-13 (``ops.kda`` floors decays there to avoid denormals), below fp32 resolution of what
# it is added to. A larger magnitude (or −inf) would only cost the chunked kernel precision in its
# cumulative sums of log-decays.
RESET_LOG_DECAY = -60.0


def causal_short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    document_starts: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution. x [B, T, C], weight [C, 1, W], state [B, C, W−1] (earlier inputs; zeros
    when None) -> (y [B, T, C], new state [B, C, W−1] = the last W−1 inputs).

    With ``document_starts`` [B, T] bool, y_t = Σ_w W[w] x_{t−w} only over lags that stay in t's document.
    With ``valid`` [B, T] bool, pads are skipped: a real token's window holds the previous real inputs and
    the state the last W−1 real ones (``nn.kda_padding``; one token: a pad keeps the state, one ``where``).
    """
    if document_starts is not None:
        return _document_conv(x, weight, document_starts), x.new_zeros(0)
    B, T, C = x.shape
    width = weight.shape[-1]
    x_bct = x.transpose(1, 2)
    history = x_bct.new_zeros(B, C, width - 1) if state is None else state.to(x.dtype)
    padded = torch.cat((history, x_bct), dim=-1)  # [B, C, W−1+T]
    if valid is not None and T > 1 and width > 1:
        return padded_short_conv(padded, weight, valid)
    y = F.conv1d(padded, weight.to(x.dtype), groups=C)
    new_state = padded[:, :, padded.shape[-1] - (width - 1) :]  # W = 1: empty, not all
    if valid is not None:  # a single token (or W = 1): a pad leaves the history as it was
        new_state = torch.where(valid[:, -1:, None], new_state, history)
    return y.transpose(1, 2), new_state


def conv_history_steps(
    x: torch.Tensor, state: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The short-convolution state after every token: x [B, T, C] (inputs), state [B, C, W−1] (before the
    window), valid [B, T] bool (None: all real) -> [B, T, C, W−1], entry t = the last W−1 real inputs up to
    and including token t (after a pad, the entry before it)."""
    if state.shape[-1] == 0:  # W = 1: no history to keep
        return x.new_zeros(*x.shape, 0)
    padded = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, W−1+T]
    if valid is not None:
        compacted, _, counts = compact_real(padded, valid)
        return real_history(compacted, counts, state.shape[-1])
    return padded.unfold(-1, state.shape[-1], 1)[:, :, 1:].transpose(1, 2)


def _document_conv(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """y_t = W[W−1] x_t + Σ_{lag ≥ 1} W[W−1−lag] x_{t−lag} [doc(t−lag) = doc(t)]. x [B, T, C], weight [C, 1, W],
    starts [B, T] bool -> y [B, T, C] (``_DocumentConv``)."""
    return _DocumentConv.apply(x, weight, starts)


class _DocumentConv(torch.autograd.Function):
    """The packed-window depthwise conv with a hand-written backward (autograd's takes a zero-filled copy per
    shifted slice and per pad). With m_lag = dy[lag:] ⊙ same_lag [B, T − lag, C]:

        dx_s = W[W−1] dy_s + Σ_lag W[W−1−lag] m_lag,s        dW[W−1−lag] = Σ_{b,t} m_lag,t x_{t−lag}

    The forward multiplies by contiguous [W, C] taps (a broadcast multiply by the strided ``weight[:, 0, j]``
    view falls off the vectorised path) and adds each lag's term on the T − lag tokens that have one: the same
    products and sums in the same order as the plain per-lag form, so bit-identical to it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # [W, C]; the last tap multiplies the current token
        taps = weight.to(x.dtype).squeeze(1).t().contiguous()
        document = starts.long().cumsum(1)  # [B, T]
        lags = range(1, min(taps.shape[0], x.shape[1]))  # lags ≥ T reach only the zeros before the window
        same = [(document[:, lag:] == document[:, :-lag]).unsqueeze(-1).to(x.dtype) for lag in lags]
        y = x * taps[-1]
        for lag, mask in zip(lags, same, strict=True):  # [B, T − lag, 1] each
            y[:, lag:] += x[:, :-lag] * taps[-1 - lag] * mask
        ctx.save_for_backward(x, taps, *same)
        ctx.weight_dtype = weight.dtype
        return y

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x, taps, *same = ctx.saved_tensors
        dy = dy.to(x.dtype)
        dx = dy * taps[-1]
        dtaps = torch.empty(taps.shape, dtype=torch.float32, device=x.device)
        dtaps[-1] = (dy * x).sum((0, 1), dtype=torch.float32)
        for lag, mask in enumerate(same, start=1):
            masked = dy[:, lag:] * mask  # m_lag [B, T − lag, C]
            dx[:, :-lag].addcmul_(masked, taps[-1 - lag])
            dtaps[-1 - lag] = (masked * x[:, :-lag]).sum((0, 1), dtype=torch.float32)
        dtaps[: taps.shape[0] - 1 - len(same)] = 0  # lags ≥ T
        return dx, dtaps.t().unsqueeze(1).to(ctx.weight_dtype), None


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dimension (the flash-linear-attention convention), [..., K] -> [..., K].

    Backward (``_L2Normalize``, one fp32 pass instead of autograd's chain through div, sqrt and sum): with
    y = x / n, n = sqrt(Σx² + eps),  dx = (dy − y (y · dy)) / n.
    """
    return _L2Normalize.apply(x, eps)


class _L2Normalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        norm = torch.sqrt((x * x).sum(-1, keepdim=True) + eps)  # [..., 1]
        y = x / norm
        ctx.save_for_backward(y, norm)
        return y

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        y, norm = ctx.saved_tensors
        y32, dy32 = y.float(), dy.float()
        dx = (dy32 - y32 * (y32 * dy32).sum(-1, keepdim=True)) / norm.float()
        return dx.to(y.dtype), None


class KimiDeltaAttention(nn.Module):
    """x [B, T, D] -> [B, T, D]. The projections run through ``k2lab.nn.decode_linear`` (as MLA's): ``F.linear``
    itself in training, and a decode step's few rows in the operand order or the compiled reduction that
    streams the weights (compiled k3-mini decode over fp32 weights 1.18–1.24× faster than through
    ``nn.Linear``'s own forward; docs/generation.md)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        D = config.hidden_size
        self.n_heads = H = config.linear_num_heads
        self.head_dim = K = config.linear_head_dim
        width = H * K
        self.q_proj = nn.Linear(D, width, bias=False)
        self.k_proj = nn.Linear(D, width, bias=False)
        self.v_proj = nn.Linear(D, width, bias=False)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(3 * width, 3 * width, kernel, groups=3 * width, bias=False)
        self.forget_gate = ForgetGate(config)
        self.b_proj = nn.Linear(D, H, bias=False)
        if config.kda_output_gate == "full_rank":
            self.g_proj = nn.Linear(D, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, width, bias=False)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, D, bias=False)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> gate logits [B, T, H·K]."""
        if hasattr(self, "g_proj"):
            return decode_linear(x, self.g_proj.weight)
        return decode_linear(decode_linear(x, self.g_a_proj.weight), self.g_b_proj.weight)

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        state: RecurrentState | None = None,
        document_starts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, D], valid [B, T] bool (None: all real), state: decode cache view, document_starts [B, T]
        bool (packed training windows: the state restarts at each document) -> [B, T, D]."""
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        keep = None if valid is None else valid.unsqueeze(-1).to(x.dtype)  # [B, T, 1]: 1 real, 0 pad
        if keep is not None:
            x = x * keep
        projected = torch.cat(
            [decode_linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1
        )
        mixed, conv_state = causal_short_conv(
            projected, self.conv1d.weight, None if state is None else state.conv, document_starts, valid
        )
        q, k, v = F.silu(mixed).view(B, T, 3, H, K).unbind(2)
        q, k = l2_normalize(q), l2_normalize(k)
        g = self.forget_gate(x)
        if document_starts is not None:
            g = g.masked_fill(document_starts[:, :, None, None], RESET_LOG_DECAY)
        beta = torch.sigmoid(decode_linear(x, self.b_proj.weight).float())
        if keep is not None:  # a pad neither decays nor writes (g = 0, β = 0): S_t = S_{t−1}
            g, beta = g * keep.unsqueeze(-1), beta * keep
        if getattr(state, "record_steps", False):  # a speculative verify window: every token's state
            out, steps = recurrent_kda_states(q, k, v, g, beta, initial_state=state.recurrent)
            state.update_steps(conv_history_steps(projected, state.conv, valid), steps)
        else:
            initial = None if state is None else state.recurrent
            # recurrent for one decode token, chunked otherwise; fla's kernels on CUDA when they import
            out, final = kda(q, k, v, g, beta, initial_state=initial, output_final_state=state is not None)
            if state is not None:
                state.update(conv_state, final)
        gate = self.output_gate(x).view(B, T, H, K)
        return decode_linear(self.o_norm(out, gate).reshape(B, T, H * K), self.o_proj.weight)
