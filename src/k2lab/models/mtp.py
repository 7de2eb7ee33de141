"""DeepSeek-V3 multi-token prediction (MTP, DeepSeek-V3 report §2.2): module k (k = 1 … K) predicts token
``i + k + 1`` at position i from the previous depth's hidden state and the embedding of token ``i + k``:

    h'_i   = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])      eh_proj: Linear(2D -> D, no bias)
    h^k_i  = Block_k(h'_i)                                          one MLA + (MoE | dense) decoder block
    P^k_{i+k+1} = softmax(lm_head(final_norm(h^k_i)))               embedding and lm_head shared with the model

h^0 is the main model's final-normed hidden state (``CausalLM.forward(..., output_hidden=True).hidden``, the
lm_head's input, as vLLM and SGLang feed their MTP layers); h^k for k >= 1 is module k's block output
(``forward``'s return, before ``final_norm``), so the depths form a causal chain. The concatenation puts the
embedding first, as the released checkpoints' ``eh_proj`` expects (the report's equation writes h first).

Checkpoint names (``k2lab.hf``): module k is HF layer ``num_hidden_layers + k - 1`` with ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm`` (= ``final_norm``), the block's usual ``self_attn.*`` / ``mlp.*`` /
``input_layernorm`` / ``post_attention_layernorm``, and copies of the shared ``embed_tokens`` and
``shared_head.head`` (= lm_head).

Running a module needs the ``LayerInputs`` of its tokens (rotary tables at their positions, the MLA mask):
``CausalLM.layer_inputs`` builds them exactly as the main forward does, including registering new tokens in a
cache; ``CausalLM.mtp_logits`` runs the whole training chain.
"""

from __future__ import annotations

import torch
from torch import nn

from k2lab.config import ModelConfig
from k2lab.models.layer import DecoderLayer, LayerInputs
from k2lab.nn.mla import LatentKV
from k2lab.nn.norm import RMSNorm


class MultiTokenPrediction(nn.Module):
    """MTP module ``depth`` (1-based): hidden [B, T, D], next_embeds [B, T, D] -> block output [B, T, D]."""

    def __init__(self, config: ModelConfig, depth: int) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"MTP depth is 1-based, got {depth}")
        D, eps = config.hidden_size, config.rms_norm_eps
        self.depth = depth
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = DecoderLayer(config, config.num_hidden_layers + depth - 1)
        self.final_norm = RMSNorm(D, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        inputs: LayerInputs,
        cache: LatentKV | None = None,
    ) -> torch.Tensor:
        """hidden = h^{k-1} [B, T, D], next_embeds = Emb(t_{i+k}) [B, T, D] -> h^k [B, T, D] (before
        ``final_norm``; logits are ``lm_head(final_norm(h^k))``)."""
        projected = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.block(projected, inputs, cache)


def shifted_embeds(embeds: torch.Tensor, shift: int) -> torch.Tensor:
    """Emb(t_{i+shift}) at position i: embeds [B, T, D] shifted left by ``shift``, zero rows at the end.

    The last ``shift`` positions have no token (they have no target either); causality keeps the zero rows
    from reaching any earlier position."""
    pad = embeds.new_zeros(embeds.shape[0], min(shift, embeds.shape[1]), embeds.shape[2])
    return torch.cat([embeds[:, shift:], pad], dim=1)
