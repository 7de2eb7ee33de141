"""MoonViT-3D (Kimi K2.5) and MoonViT-V2 (Kimi K3): the native-resolution vision tower plus its MLP projector.

Inputs follow transformers' ``Kimi_K25ImageProcessor``: ``pixel_values`` [N, C, p, p] holds the patches
of every image / video volume back to back (per entry frame-major, then raster order within a frame),
``grid_thw`` [E, 3] the (t, h, w) patch grid of each entry, so entry e owns ``t_e·h_e·w_e`` rows.
Images have t = 1; a video is cut into volumes of at most ``pos_emb_time`` (4) consecutive frames, each
one entry, encoded with the same weights as images.

Pipeline (N patches, E entries, D = hidden_size, A = attention width, M merged tokens):

1. patch embedding   x_n = W_p · vec(patch_n) + b_p                                      [N, D]
2. positions         x_n += P̃_e[r_n, c_n] + τ(f_n)  — the learned [H, W, D] grid P bicubically (K2.5) or
   bilinearly (K3) resampled to (h_e, w_e), and for t_e > 1 a sin/cos frame embedding
   τ(f) = [sin(f·ω), cos(f·ω)], ω_k = 10000^(-2k/D)
3. L pre-norm blocks  x += W_o Attn(LN₁ x);  x += MLP(LN₂ x)  with q, k, v [N, A] (A = D for K2.5,
   A = 1536 > D = 1024 for K3), attention confined to each entry (block-diagonal over the packed sequence;
   a volume's frames attend to each other) and 2-D axial rope on q, k
4. final LayerNorm, then temporal pooling + spatial grouping: for each entry the mean over its t frames
   of each kh×kw block, kept as kh·kw vectors                                            [M, kh·kw, D]
   with M = Σ_e (h_e / kh)(w_e / kw) — a 4-frame volume yields as many tokens as one frame
5. projector         y = W₂ · GELU(W₁ · concat(LN(z_1..z_{kh·kw})) + b₁) + b₂             [M, D_text]

MoonViT-V2 (``VisionConfig.moonvit_v2()``, the released K3 tower that vLLM builds with its K2.5
``MoonViT3dPretrainedModel`` driven by K3's ``vision_config``) is the same code with these switches: every
LayerNorm becomes RMSNorm (``norm="rmsnorm"``, eps 2⁻²³: torch's ``nn.RMSNorm`` default), every projection
(patch conv, q/k/v/o, MLPs, projector) loses its bias (``bias=False``), q/k/v are ``qkv_hidden_size`` wide,
the position grid is resampled bilinearly, and the projector is "patchmergerv2" (``merge="pixel_shuffle"``):
step 4 is ``mean_t pixel_shuffle(x)`` [M, kh·kw·D] — the same numbers as K2.5's grouping, flattened — and
step 5 becomes y = RMSNorm(W₂ · GELU(W₁ · z)) [M, D_text]: no norm before, one on the output. (Before the
release we had the RMSNorm in front of W₁, over the kh·kw·D token; the released code has it after W₂.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.nn.norm import RMSNorm
from k2lab.vision.config import VisionConfig

__all__ = [
    "MoonViT3D",
    "MoonViTEncoder",
    "MoonViTV2",
    "VisionOutput",
    "VisionProjector",
    "axial_rope",
    "num_parameters",
    "segment_lengths",
    "apply_rope",
    "check_grid",
    "check_patches",
    "make_norm",
    "patch_coordinates",
    "pixel_shuffle",
    "temporal_merge",
    "time_embedding",
    "video_volumes",
    "vision_token_counts",
]


# ----------------------------------------------------------------------------------------------- grids


def _grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def check_grid(grid_thw: torch.Tensor, num_patches: int, config: VisionConfig) -> None:
    """Raise ``ValueError`` unless ``grid_thw`` [E, 3] describes ``num_patches`` patches the tower accepts."""
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [E, 3], got {tuple(grid_thw.shape)}")
    kh, kw = config.merge_kernel_size
    total = 0
    for e, (t, h, w) in enumerate(_grid_list(grid_thw)):
        if min(t, h, w) <= 0:
            raise ValueError(f"grid_thw[{e}]={(t, h, w)} must be positive")
        if t > config.pos_emb_time:
            raise ValueError(f"grid_thw[{e}] has t={t} frames, more than pos_emb_time={config.pos_emb_time}")
        if h % kh or w % kw:
            raise ValueError(f"grid_thw[{e}] h×w={h}×{w} is not divisible by merge_kernel_size={(kh, kw)}")
        total += t * h * w
    if total != num_patches:
        raise ValueError(f"grid_thw describes {total} patches but pixel_values has {num_patches}")


def check_patches(pixel_values: torch.Tensor, config: VisionConfig) -> None:
    """Raise ``ValueError`` unless ``pixel_values`` is [N, 3, p, p] for the tower's patch size p (the
    processor's layout; the stride-p patch convolution would crop larger patches and fail on smaller)."""
    p = config.patch_size
    if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
        raise ValueError(
            f"pixel_values must be [N, 3, {p}, {p}] patches (patch_size={p}), got {tuple(pixel_values.shape)}"
        )


def vision_token_counts(grid_thw: torch.Tensor, merge_kernel_size: tuple[int, int]) -> list[int]:
    """Tokens each entry gives the language model: (h / kh)·(w / kw), independent of t (temporal pooling)."""
    kh, kw = merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in _grid_list(grid_thw)]


def video_volumes(num_frames: int, h: int, w: int, max_frames: int = 4) -> list[tuple[int, int, int]]:
    """Cut a video's patch grid into consecutive volumes of at most ``max_frames`` frames (grid_thw rows)."""
    return [(min(max_frames, num_frames - s), h, w) for s in range(0, num_frames, max_frames)]


def patch_coordinates(grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every packed patch within its frame, each [N] long (frame-major, raster order)."""
    rows, cols = [], []
    for t, h, w in _grid_list(grid_thw):
        r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        rows.append(r.flatten().repeat(t))
        cols.append(c.flatten().repeat(t))
    return torch.cat(rows).to(grid_thw.device), torch.cat(cols).to(grid_thw.device)


# ------------------------------------------------------------------------------------------- positions


def time_embedding(num_frames: int, dim: int) -> torch.Tensor:
    """τ(f) = [sin(f·ω_0..ω_{D/2-1}), cos(f·ω_0..ω_{D/2-1})], ω_k = 10000^(-2k/D), f < num_frames. [T, D] fp32."""
    omega = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(num_frames, dtype=torch.float32)[:, None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PositionEmbedding(nn.Module):
    """Learned [H, W, D] grid, bicubically / bilinearly resampled per entry, plus τ(f) for multi-frame volumes."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.mode = config.pos_emb_interpolation
        self.weight = nn.Parameter(
            torch.zeros(config.pos_emb_height, config.pos_emb_width, config.hidden_size)
        )

    def resample(self, h: int, w: int) -> torch.Tensor:
        """P̃ = bicubic (border-clamped taps, a = -0.75) or bilinear (P → h×w), align_corners=False. [h·w, D].

        At h×w = H×W both are the identity (pixel centres coincide), as vLLM's shortcut to P itself."""
        grid = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, D, H, W]
        out = F.interpolate(grid, size=(h, w), mode=self.mode, align_corners=False)
        return out[0].flatten(1).transpose(0, 1)

    def forward(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Additive position term of every packed patch. [N, D]."""
        parts = []
        for t, h, w in _grid_list(grid_thw):
            spatial = self.resample(h, w)  # [h·w, D]
            if t > 1:
                tau = time_embedding(t, spatial.shape[-1]).to(spatial)
                spatial = (spatial[None] + tau[:, None]).flatten(0, 1)
            parts.append(spatial)
        return torch.cat(parts)


def axial_rope(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] of the 2-D axial rope in the rotate-half layout transformers uses.

    With ω_j = θ^(-4j/d), j < d/4, the d/2 angles of a patch at (r, c) interleave the two axes:
    φ_{2j} = c·ω_j, φ_{2j+1} = r·ω_j; cos/sin are [φ, φ] (duplicated for the two halves).
    """
    omega = 1.0 / theta ** (
        torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=rows.device) / (head_dim // 2)
    )
    phi = torch.stack([cols.float()[:, None] * omega, rows.float()[:, None] * omega], dim=-1).flatten(1)
    phi = torch.cat([phi, phi], dim=-1)
    return phi.cos(), phi.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d]: y_i = x_i cos φ_i − x_{i+d/2} sin φ_i, y_{i+d/2} = x_{i+d/2} cos φ_i + x_i sin φ_i (fp32)."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


# ----------------------------------------------------------------------------------------------- blocks


def make_norm(config: VisionConfig, dim: int, eps: float) -> nn.Module:
    """The variant's norm over the last dim: LayerNorm (bias iff ``config.bias``) or RMSNorm (weight only).

    LN(x) = γ ⊙ (x − μ) / √(σ² + ε) + β;  RMSNorm(x) = γ ⊙ x / √(mean(x²) + ε).
    """
    if config.norm == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=config.bias)


class VisionAttention(nn.Module):
    """Multi-head self-attention (q/k/v/o biased iff ``config.bias``) confined to each packed segment.

    q, k, v = W_{q,k,v} x [N, A] with A = heads × d (``attention_width``; 1536 = 12 × 128 for K3's D = 1024),
    then W_o [D, A] back to D. softmax(q_s k_sᵀ / √d) v_s per segment s = [cu[s], cu[s+1]) — exactly
    block-diagonal attention over the packed sequence, computed as one SDPA call per segment so no [N, N]
    mask is materialised.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d, a = config.hidden_size, config.attention_width
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.q, self.k, self.v = (nn.Linear(d, a, bias=config.bias) for _ in range(3))
        self.o = nn.Linear(a, d, bias=config.bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """x [N, D], cos/sin [N, head_dim], lengths: tokens per segment (sum N). -> [N, D] (via [N, A])."""
        n = x.shape[0]
        q = apply_rope(self.q(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rope(self.k(x).view(n, self.heads, self.head_dim), cos, sin)
        v = self.v(x).view(n, self.heads, self.head_dim)
        outs = [
            F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return self.o(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """fc_out(act(fc_in x)), act = tanh-approximated GELU by default. [N, D] -> [N, D]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    """Pre-norm encoder layer: x += Attn(N₁ x); x += MLP(N₂ x), N = LayerNorm (K2.5) or RMSNorm (V2)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(config, config.hidden_size, config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.mlp_norm = make_norm(config, config.hidden_size, config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, lengths)
        return x + self.mlp(self.mlp_norm(x))


def pixel_shuffle(x: torch.Tensor, factor: tuple[int, int] = (2, 2)) -> torch.Tensor:
    """Space-to-depth: [..., h, w, D] -> [..., h/kh, w/kw, kh·kw·D] (a pure rearrangement, no arithmetic).

    y[..., i, j, (a·kw + b)·D + d] = x[..., i·kh + a, j·kw + b, d] for a < kh, b < kw: the kh·kw patches of a
    block are concatenated in raster order (row offset a major, column offset b minor), each keeping its D
    channels contiguous. K2.5's projector input ``pooled[m]`` [kh·kw, D] is exactly this token unflattened.
    """
    kh, kw = factor
    *lead, h, w, d = x.shape
    if h % kh or w % kw:
        raise ValueError(f"pixel_shuffle: grid {h}×{w} is not divisible by {kh}×{kw}")
    blocks = x.reshape(*lead, h // kh, kh, w // kw, kw, d).transpose(-4, -3)
    return blocks.reshape(*lead, h // kh, w // kw, kh * kw * d)


def temporal_merge(
    x: torch.Tensor, grid_thw: torch.Tensor, merge_kernel_size: tuple[int, int]
) -> torch.Tensor:
    """Pixel-shuffle every frame, then mean over frames: [N, D] -> [M, kh·kw, D].

    For entry (t, h, w): z[m, (a·kw + b)] = (1/t) Σ_f x[f, i·kh + a, j·kw + b] with m = i·(w/kw) + j, i.e.
    z = mean_f pixel_shuffle(x_f) viewed as kh·kw vectors of D. The mean is taken in fp32 (vLLM's
    ``tpool_patch_merger`` takes it in the activation dtype: the same in fp32, ≤ 1 ulp apart in bf16).
    """
    kh, kw = merge_kernel_size
    d = x.shape[-1]
    parts = []
    for seg, (t, h, w) in zip(x.split(segment_lengths(grid_thw)), _grid_list(grid_thw), strict=True):
        shuffled = pixel_shuffle(seg.float().view(t, h, w, d), (kh, kw))  # [t, h/kh, w/kw, kh·kw·D]
        parts.append(shuffled.mean(0).reshape(-1, kh * kw, d))
    return torch.cat(parts).to(x.dtype)


def segment_lengths(grid_thw: torch.Tensor) -> list[int]:
    """Packed tokens per entry, t·h·w (a whole volume is one attention segment)."""
    return [t * h * w for t, h, w in _grid_list(grid_thw)]


# ----------------------------------------------------------------------------------------------- models


class MoonViTEncoder(nn.Module):
    """Patch embedding, positions, L encoder blocks and the final norm. -> [N, D]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        self.patch_embed = nn.Conv2d(3, config.hidden_size, kernel_size=p, stride=p, bias=config.bias)
        self.pos_embed = PositionEmbedding(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_hidden_layers))
        self.final_norm = make_norm(config, config.hidden_size, config.layer_norm_eps)

    def embed(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[N, 3, p, p] -> [N, D]: W_p · vec(patch) (+ b_p) + position term (cast to the activation dtype)."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).flatten(1)
        return x + self.pos_embed(grid_thw).to(x.dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        check_patches(pixel_values, self.config)
        check_grid(grid_thw, pixel_values.shape[0], self.config)
        x = self.embed(pixel_values, grid_thw)
        rows, cols = patch_coordinates(grid_thw)
        cos, sin = axial_rope(rows, cols, self.config.head_dim, self.config.rope_theta)
        lengths = segment_lengths(grid_thw)
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.final_norm(x)


class VisionProjector(nn.Module):
    """fc_out(GELU(fc_in ·)) with a norm before (K2.5) or after (K3): [M, kh·kw, D] -> [M, D_text].

    ``merge="in_projector"`` (K2.5's "patchmerger"): y = W₂ GELU(W₁ concat(LN(z_1), …, LN(z_{kh·kw})) + b₁) + b₂,
    the norm (``norm``) D wide acting on each patch vector. ``merge="pixel_shuffle"`` (K3's "patchmergerv2"):
    y = RMSNorm(W₂ GELU(W₁ z)) with z = flatten(pooled) the shuffled kh·kw·D token and the norm
    (``post_norm``) D_text wide, eps ``projection_layer_norm_eps``. GELU is the exact (erf) one in both.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        width = config.hidden_size * config.merge_area
        self.shuffled = config.merge == "pixel_shuffle"
        if self.shuffled:
            self.post_norm = make_norm(config, config.text_hidden_size, config.projection_layer_norm_eps)
        else:
            self.norm = make_norm(config, config.hidden_size, config.projection_layer_norm_eps)
        self.fc_in = nn.Linear(width, width, bias=config.bias)
        self.fc_out = nn.Linear(width, config.text_hidden_size, bias=config.bias)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.shuffled:
            return self.post_norm(self.fc_out(F.gelu(self.fc_in(pooled.flatten(1)))))
        return self.fc_out(F.gelu(self.fc_in(self.norm(pooled).flatten(1))))


@dataclass
class VisionOutput:
    """features [M, D_text] (what replaces the media placeholder tokens), last_hidden_state [N, D],
    pooled [M, kh·kw, D] (``pooled.flatten(1)`` is the pixel-shuffled token); ``counts`` — tokens per grid
    entry (split ``features`` by it)."""

    features: torch.Tensor
    last_hidden_state: torch.Tensor
    pooled: torch.Tensor
    counts: list[int]


class MoonViT3D(nn.Module):
    """The tower and the projector: packed patches + grid_thw -> language-model-width vision tokens.

    One class for both variants: ``MoonViT3D(VisionConfig.moonvit_3d())`` is K2.5's tower,
    ``MoonViT3D(VisionConfig.moonvit_v2())`` K3's MoonViT-V2 (``MoonViTV2`` is an alias).
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = MoonViTEncoder(config)
        self.projector = VisionProjector(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        hidden = self.encoder(pixel_values, grid_thw)
        pooled = temporal_merge(hidden, grid_thw, self.config.merge_kernel_size)
        counts = vision_token_counts(grid_thw, self.config.merge_kernel_size)
        return VisionOutput(self.projector(pooled), hidden, pooled, counts)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Truncated-normal weights (std), zero biases, unit norm gains."""
        for name, p in self.named_parameters():
            with torch.no_grad():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    nn.init.trunc_normal_(p, std=std, a=-2 * std, b=2 * std)


MoonViTV2 = MoonViT3D  # K3's tower: build with ``VisionConfig.moonvit_v2()``


def num_parameters(config: VisionConfig, include_projector: bool = True) -> int:
    """Exact parameter count of ``MoonViT3D(config)`` by formula (tower, plus the projector by default).

    With b = 1 if biased else 0, n(w) = w·(1 + b) for LayerNorm, w for RMSNorm, A the attention width:
    tower = 3p²D + bD + H·W·D + L·(3DA + 3bA + AD + bD + 2DF + b(F + D) + 2n(D)) + n(D);
    projector = (kD)² + bkD + kD·D_text + bD_text + n(D) (K2.5, pre-norm) or n(D_text) (K3, post-norm),
    k = kh·kw.
    """
    d, f, p, k, t = (
        config.hidden_size,
        config.intermediate_size,
        config.patch_size,
        config.merge_area,
        config.text_hidden_size,
    )
    b = int(config.bias)

    def n(width: int) -> int:
        return width * (1 + b) if config.norm == "layernorm" else width

    a = config.attention_width
    block = 4 * d * a + 3 * b * a + b * d + 2 * d * f + b * (f + d) + 2 * n(d)
    tower = 3 * p * p * d + b * d + config.pos_emb_height * config.pos_emb_width * d
    tower += config.num_hidden_layers * block + n(d)
    if not include_projector:
        return tower
    norm_width = t if config.merge == "pixel_shuffle" else d
    return tower + n(norm_width) + (k * d) ** 2 + b * k * d + k * d * t + b * t
