"""The K2-family decoder: embeddings, pre-norm blocks of MLA + (dense SwiGLU | MoE), final norm, LM head.

    h ← h + Attn(RMSNorm(h));  h ← h + FFN(RMSNorm(h));  logits = W_head RMSNorm(h)

Layer ``i`` uses the dense MLP when ``i < first_k_dense_replace`` and the MoE otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k2lab.config import ModelConfig, YarnScaling
from k2lab.infer.cache import LatentCache
from k2lab.nn.mla import AttentionMask, LatentKV, MultiHeadLatentAttention
from k2lab.nn.mlp import SwiGLU
from k2lab.nn.moe import MoE
from k2lab.nn.norm import RMSNorm
from k2lab.nn.rope import RotaryEmbedding


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = MultiHeadLatentAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer_idx)
            else SwiGLU(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: LatentKV | None = None,
    ) -> torch.Tensor:
        """h [B, T, D], cos/sin [B, T, r/2] -> [B, T, D]."""
        h = h + self.attn(self.attn_norm(h), cos, sin, mask, cache)
        return h + self.mlp(self.mlp_norm(h))


def attention_mask_for(query_start: int, key_valid: torch.Tensor | None, num_queries: int) -> AttentionMask:
    """Queries at absolute positions [start, start+Tq) see earlier valid keys (and always themselves).

    key_valid [B, Tk] bool or None (no padding, no cache: plain causal). Returns ``allowed`` [B, 1, Tq, Tk].
    Letting a padding query see itself keeps its softmax finite; its output is never used.
    """
    if key_valid is None:
        return AttentionMask(None)
    Tk = key_valid.shape[1]
    q_pos = torch.arange(query_start, query_start + num_queries, device=key_valid.device)[:, None]
    k_pos = torch.arange(Tk, device=key_valid.device)[None, :]
    allowed = ((k_pos <= q_pos) & key_valid[:, None, :]) | (k_pos == q_pos)
    return AttentionMask(allowed.unsqueeze(1))


class CausalLM(nn.Module):
    """``model(input_ids).logits`` -> [B, T, V].

    ``attention_mask`` [B, T] (1 = real token) supports padded batches; positions then count real tokens
    only, so left-padded prompts get the positions they would have alone. ``cache`` (``LatentCache``) makes
    the call incremental: the new tokens attend to everything cached and are appended to it.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LatentCache | None = None,
    ) -> CausalLMOutput:
        B, T = input_ids.shape
        valid = None if attention_mask is None else attention_mask.bool()
        if cache is not None:
            valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if valid is None else valid
            positions, key_valid = cache.begin(valid)
            query_start = cache.length
        else:
            positions = _positions(valid, B, T, input_ids.device)
            key_valid, query_start = valid, 0
        if position_ids is not None:
            positions = position_ids.expand(B, T)

        mask = attention_mask_for(query_start, key_valid, T)
        cos, sin = self.rotary(positions)
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, None if cache is None else cache.layer(i))
        if cache is not None:
            cache.commit(valid)
        return CausalLMOutput(logits=self.lm_head(self.norm(h)))

    def set_rope_scaling(self, rope_scaling: YarnScaling | None) -> None:
        """Switch YaRN (context extension): new rotary frequencies and softmax temperature, same weights."""
        self.config = self.config.replace(rope_scaling=rope_scaling)
        self.rotary.config = self.config
        self.rotary.reset_buffers()
        for layer in self.layers:
            layer.attn.softmax_scale = self.config.softmax_scale

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]


def _positions(valid: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    if valid is None:
        return torch.arange(T, device=device).expand(B, T)
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int | None = 0) -> CausalLM:
    """Construct and initialise a model. On the meta device nothing is allocated or initialised."""
    from k2lab.models.init import init_weights

    with torch.device(device):
        model = CausalLM(config)
    if torch.device(device).type != "meta":
        init_weights(model, seed=seed)
    return model
