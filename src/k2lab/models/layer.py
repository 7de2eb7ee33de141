"""One pre-norm decoder block, (MLA | KDA) then (dense MLP | MoE), and the per-forward inputs every block shares.

    h ← h + Mix(RMSNorm(h));  h ← h + FFN(RMSNorm(h))

Layer ``i < num_hidden_layers`` mixes tokens as ``config.layer_types[i]`` says and uses the MoE when
``config.is_moe_layer(i)``. Indices from ``num_hidden_layers`` on are the multi-token-prediction blocks
(DeepSeek-V3's layer 61, ``k2lab.models.mtp``): always MLA (with or without RoPE as the config says, so a
KDA hybrid's MTP block is its MLA kind), the MoE by the same ``is_moe_layer`` rule (as in the checkpoint
layout), and plain residuals even under Block AttnRes (the MTP block runs on its own stream; vLLM's K3 MTP
builds its block with ``attn_res_block_size = None`` likewise).

Called with a ``BlockAttnResState`` instead of h, a layer is the released K3 layer (mlx-lm / vLLM ``kimi_k3``):
AttnRes read -> ``input_layernorm`` -> attention, added to the partial block sum; AttnRes read ->
``post_attention_layernorm`` -> MLP, added too. Both forms go through ``__call__`` and return a tensor, so
FSDP2's per-layer hooks (gather the shards before forward and backward) fire for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.activations import mlp_activation
from k2lab.nn.attnres import AttnRes, BlockAttnResState
from k2lab.nn.kda import KimiDeltaAttention, RecurrentState
from k2lab.nn.mla import AttentionMask, LatentKV, MultiHeadLatentAttention
from k2lab.nn.mlp import GatedMLP
from k2lab.nn.moe import MoE
from k2lab.nn.norm import RMSNorm


@dataclass
class LayerInputs:
    """What every layer of one forward shares: rotary tables (None without RoPE), the MLA mask and which
    tokens are real (``valid`` [B, T] bool, None when all are)."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    mask: AttentionMask
    valid: torch.Tensor | None
    document_starts: torch.Tensor | None = None  # [B, T] bool: a packed document begins here


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        main = layer_idx < config.num_hidden_layers
        self.kind = config.layer_types[layer_idx] if main else "mla"
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn: nn.Module = (
            MultiHeadLatentAttention(config) if self.kind == "mla" else KimiDeltaAttention(config)
        )
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer_idx)
            else GatedMLP(config.hidden_size, config.intermediate_size, mlp_activation(config))
        )
        if config.attnres_block_size is not None and main:
            self.attn_res = AttnRes(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = AttnRes(config.hidden_size, config.rms_norm_eps)

    def mix(
        self, x: torch.Tensor, inputs: LayerInputs, cache: LatentKV | RecurrentState | None = None
    ) -> torch.Tensor:
        """Token mixing of normed x [B, T, D] -> [B, T, D] by this layer's MLA or KDA."""
        if self.kind == "kda":
            return self.attn(x, inputs.valid, cache, inputs.document_starts)
        return self.attn(x, inputs.cos, inputs.sin, inputs.mask, cache)

    def forward(
        self,
        h: torch.Tensor | BlockAttnResState,
        inputs: LayerInputs,
        cache: LatentKV | RecurrentState | None = None,
    ) -> torch.Tensor:
        """h [B, T, D] -> [B, T, D]; a ``BlockAttnResState`` h -> its partial block sum [B, T, D] after this
        layer (``_forward_attnres``)."""
        if isinstance(h, BlockAttnResState):
            return self._forward_attnres(h, inputs, cache)
        h = h + self.mix(self.attn_norm(h), inputs, cache)
        return h + self.mlp(self.mlp_norm(h))

    def _forward_attnres(
        self, state: BlockAttnResState, inputs: LayerInputs, cache: LatentKV | RecurrentState | None
    ) -> torch.Tensor:
        """Block AttnRes form: read the depth sources before each sub-layer, add its output to the partial sum
        (returned, [B, T, D])."""
        state.add(self.mix(self.attn_norm(self.attn_res.read(state)), inputs, cache))
        state.add(self.mlp(self.mlp_norm(self.mlp_res.read(state))))
        return state.partial
