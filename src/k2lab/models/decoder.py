"""The K2-family decoder: embeddings, pre-norm blocks of (MLA | KDA) + (dense MLP | MoE), final norm, LM head.

    h ← h + Mix(RMSNorm(h));  h ← h + FFN(RMSNorm(h));  logits = W_head RMSNorm(h)

Layer ``i`` mixes tokens with MLA or KDA as ``config.layer_types[i]`` says (K2: all MLA; Kimi Linear and K3:
KDA with an MLA layer every fourth and at the end) and uses the dense MLP when ``i < first_k_dense_replace``,
the MoE otherwise.

With Block AttnRes (K3, ``attnres_block_size``) the residual stream is replaced by depth-wise attention:
before each attention, each MLP and the final norm, ``AttnRes`` mixes the embedding, the completed block
sums and the current partial block sum (``k2lab.nn.attnres``); sub-layer outputs accumulate into the partial sum.

With ``num_nextn_predict_layers = K > 0`` the model also holds K DeepSeek-V3 multi-token-prediction modules
(``self.mtp``, ``k2lab.models.mtp``) sharing its embedding and head; the plain forward never runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from k2lab.config import ModelConfig, YarnScaling
from k2lab.infer.cache import LatentCache
from k2lab.models.init import constructing_on, init_weights
from k2lab.models.layer import DecoderLayer, LayerInputs
from k2lab.models.mtp import MultiTokenPrediction, shifted_embeds
from k2lab.nn.attnres import AttnRes, BlockAttnResState
from k2lab.nn.decode_linear import decode_linear
from k2lab.nn.mla import AttentionMask
from k2lab.nn.moe import MoE
from k2lab.nn.norm import RMSNorm
from k2lab.nn.rope import RotaryEmbedding
from k2lab.ops.linear_cross_entropy import linear_cross_entropy

__all__ = [
    "CausalLM",
    "CausalLMOutput",
    "DecoderLayer",
    "LayerInputs",
    "attention_mask_for",
    "build_model",
    "document_mask",
    "document_positions",
    "document_starts",
]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # [B, T, V] ([N, V] under logits_mask); None when ``labels`` gave ``loss``
    hidden: torch.Tensor | None = None  # [B, T, D] final-normed hidden (the lm_head's input) if asked for
    loss: torch.Tensor | None = None  # mean next-token cross-entropy against ``labels`` (scalar)


def document_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [B, T] (non-decreasing per row) -> [B, T] bool, True where a new document begins."""
    starts = torch.zeros_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its own document: starts [B, T] bool -> [B, T] int64."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def document_mask(segment_ids: torch.Tensor) -> AttentionMask:
    """Causal attention confined to each packed document: allowed [B, 1, T, T]."""
    T = segment_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return AttentionMask((same & causal).unsqueeze(1))


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
    only, so left-padded prompts get the positions they would have alone. A [B, T, T] bool
    ``attention_mask`` says which key each query may see (``allowed[b, q, k]``), with ``position_ids``
    [B, T] required: token trees such as ``k2lab.posttrain.prefix_tree``'s packs (MLA-only models, no
    cache). ``cache`` (``LatentCache``) makes the call incremental: the new tokens attend to everything
    cached and are appended to it.
    ``inputs_embeds`` [B, T, D] replaces ``input_ids`` (the VLM splices vision features into them).
    ``segment_ids`` [B, T] (packed training windows) confines every token to its own document: MLA masks
    other documents and restarts positions, KDA restarts its state and short convolution, so each
    document's logits equal those of running it alone.
    ``logits_mask`` [B, T] (bool) computes the head only where it is True: logits [N, V] for the N selected
    positions in row-major order (scoring a few completion tokens after a long prompt skips the prompt's
    [T, V] logits).
    ``output_hidden=True`` also returns ``hidden``, the final-normed hidden state of every position [B, T, D]
    (the head's input, also under ``logits_mask``): h^0 of the MTP modules ``self.mtp`` (``mtp_logits``, ``k2lab.models.mtp``).
    ``labels`` [B, T] (the token each position predicts, -100 where none) returns ``loss``, their mean
    cross-entropy, instead of the logits: the head and the loss run fused (``ops.linear_cross_entropy``),
    without the [B, T, V] logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attnres_block_size is not None:
            self.final_res = AttnRes(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = RotaryEmbedding(config) if config.uses_rope else None
        self.mtp = nn.ModuleList(
            MultiTokenPrediction(config, depth) for depth in range(1, config.num_nextn_predict_layers + 1)
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LatentCache | None = None,
        segment_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
        output_hidden: bool = False,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, D]")
        if labels is not None and (cache is not None or logits_mask is not None):
            raise ValueError("labels give a training loss: pass them without cache and logits_mask")
        check_inputs(input_ids, inputs_embeds, attention_mask, labels)
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        inputs = self.layer_inputs(B, T, h.device, attention_mask, position_ids, cache, segment_ids)
        h = (
            self._layers_attnres(h, inputs, cache)
            if hasattr(self, "final_res")
            else self._layers(h, inputs, cache)
        )
        if cache is not None:
            cache.commit(inputs.valid, T)
        keep = None if logits_mask is None else logits_mask.to(device=h.device, dtype=torch.bool)
        if output_hidden:
            h = hidden = self.norm(h)
            h = h if keep is None else h[keep]
        else:  # only the positions the head reads are normed
            hidden = None
            h = self.norm(h if keep is None else h[keep])
        if labels is not None:
            loss = linear_cross_entropy(h, self.lm_head.weight, labels.to(h.device))
            return CausalLMOutput(logits=None, hidden=hidden, loss=loss)
        # decode steps (a cache, a few rows): the head's product through decode_linear's decode tiers
        logits = self.lm_head(h) if cache is None else decode_linear(h, self.lm_head.weight)
        return CausalLMOutput(logits=logits, hidden=hidden)

    def layer_inputs(
        self,
        B: int,
        T: int,
        device: torch.device,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LatentCache | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> LayerInputs:
        """The ``LayerInputs`` of T new tokens per row, as ``forward`` builds them (same arguments): positions
        (counting real tokens, continuing a cache, restarting per packed document), rotary tables, the MLA
        mask. With ``cache`` the tokens are registered (``cache.begin``) and the caller commits them
        (``cache.commit(valid, T)``) once every layer has appended; ``valid`` stays None without an
        ``attention_mask`` (a decode step: KDA layers then skip their pad masking). MTP modules run on these
        same inputs."""
        if segment_ids is not None and (cache is not None or attention_mask is not None):
            raise ValueError(
                "segment_ids describe packed training windows: use them without cache or padding"
            )
        if attention_mask is not None and attention_mask.dim() == 3:
            return self._tree_inputs(attention_mask, position_ids, cache, segment_ids)
        valid = None if attention_mask is None else attention_mask.bool()
        if cache is not None:
            registered = torch.ones(B, T, dtype=torch.bool, device=device) if valid is None else valid
            positions, key_valid = cache.begin(registered)
            query_start = cache.length
        else:
            positions = _positions(valid, B, T, device)
            key_valid, query_start = valid, 0
        if position_ids is not None:
            positions = position_ids.expand(B, T)

        mask = attention_mask_for(query_start, key_valid, T)
        starts = None
        if segment_ids is not None:
            starts = document_starts(segment_ids)
            positions, mask = document_positions(starts), document_mask(segment_ids)
        cos, sin = self.rotary(positions) if self.rotary is not None else (None, None)
        return LayerInputs(cos, sin, mask, valid, starts)

    def _tree_inputs(
        self,
        allowed: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: LatentCache | None,
        segment_ids: torch.Tensor | None,
    ) -> LayerInputs:
        """``LayerInputs`` of a [B, T, T] mask: each query sees the keys it allows, at ``position_ids``."""
        if position_ids is None or cache is not None or segment_ids is not None:
            raise ValueError("a [B, T, T] attention_mask needs position_ids, and no cache or segment_ids")
        if self.config.has_kda:
            raise ValueError(
                "a [B, T, T] attention_mask needs an MLA-only model: KDA layers read tokens in order"
            )
        cos, sin = self.rotary(position_ids) if self.rotary is not None else (None, None)
        return LayerInputs(cos, sin, AttentionMask(allowed.bool().unsqueeze(1)), None)

    def mtp_logits(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Training chain of the MTP modules: logits [B, T, V] per depth k = 1 … K.

        input_ids [B, T] = t_0 … t_{T-1}; hidden [B, T, D] = h^0, the main forward's ``hidden`` on the same
        ids (and ``segment_ids``). Depth k at position i reads h^{k-1}_i and Emb(t_{i+k}) and predicts
        t_{i+k+1}; its rows i >= T - k have no input token (a zero embedding) and no target, so with the
        packed ``labels = window[1:]`` the loss pairs ``logits[:, : T - k]`` with ``labels[:, k:]``.
        """
        return [self.lm_head(normed) for normed in self.mtp_hidden(input_ids, hidden, segment_ids)]

    def mtp_hidden(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, segment_ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``mtp_logits`` before the head: final_norm(h^k) [B, T, D] per depth k (the training loss takes the
        head and its cross-entropy fused, ``k2lab.train.mtp_loss.fused_mtp_loss``)."""
        B, T = input_ids.shape
        embeds = self.embed(input_ids)
        inputs = self.layer_inputs(B, T, hidden.device, segment_ids=segment_ids)
        normed = []
        for module in self.mtp:
            hidden = module(hidden, shifted_embeds(embeds, module.depth), inputs)
            normed.append(module.final_norm(hidden))
        return normed

    def _layers(self, h: torch.Tensor, inputs: LayerInputs, cache: LatentCache | None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = layer(h, inputs, None if cache is None else cache.layer(i))
        return h

    def _layers_attnres(
        self, h: torch.Tensor, inputs: LayerInputs, cache: LatentCache | None
    ) -> torch.Tensor:
        state = BlockAttnResState(h, self.config.attnres_block_size)
        for i, layer in enumerate(self.layers):
            state.start_layer(i)
            # through __call__ (FSDP2's hooks), and the result kept: under FSDP2 the layer adds to a copy
            state.partial = layer(state, inputs, None if cache is None else cache.layer(i))
        return self.final_res.read(state)

    def set_rope_scaling(self, rope_scaling: YarnScaling | None) -> None:
        """Switch YaRN (context extension): new rotary frequencies and softmax temperature, same weights."""
        self.config = self.config.replace(rope_scaling=rope_scaling)
        if self.rotary is not None:
            self.rotary.config = self.config
            self.rotary.reset_buffers()
        for layer in self.blocks():
            if layer.kind == "mla":
                layer.attn.softmax_scale = self.config.softmax_scale

    def blocks(self) -> list[DecoderLayer]:
        """Every decoder block: the main layers, then the MTP modules' blocks (HF layer order)."""
        return [*self.layers, *(module.block for module in self.mtp)]

    def moe_layers(self) -> list[MoE]:
        """The MoE of every block, MTP blocks last (their routers balance like the main ones)."""
        return [layer.mlp for layer in self.blocks() if isinstance(layer.mlp, MoE)]


def _positions(valid: torch.Tensor | None, B: int, T: int, device: torch.device) -> torch.Tensor:
    if valid is None:
        return torch.arange(T, device=device).expand(B, T)
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def check_inputs(
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor | None,
) -> None:
    """``ValueError`` naming the argument for inputs ``forward`` cannot take (shapes and dtypes only, no
    host sync): input_ids [B, T] integer ids, inputs_embeds [B, T, D], T ≥ 1, a 2-D attention_mask and
    labels of the same [B, T]. Ids outside the vocabulary are left to the embedding's IndexError."""
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T] token ids, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids (torch.long), got {input_ids.dtype}")
        shape = tuple(input_ids.shape)
    else:
        assert inputs_embeds is not None
        if inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be [B, T, D], got shape {tuple(inputs_embeds.shape)}")
        shape = tuple(inputs_embeds.shape[:2])
    if shape[1] == 0:
        raise ValueError("the inputs hold no tokens (T = 0)")
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels)):
        if tensor is not None and tensor.dim() == 2 and tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must be [B, T] = {list(shape)} like the inputs, got {list(tensor.shape)}"
            )
    if labels is not None and labels.dim() != 2:
        raise ValueError(f"labels must be [B, T] = {list(shape)} like the inputs, got {list(labels.shape)}")


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int | None = 0) -> CausalLM:
    """Construct and initialise a model. On the meta device nothing is allocated or initialised."""
    if not isinstance(config, ModelConfig):
        hint = f" (a preset name: build_model(load_preset({config!r})))" if isinstance(config, str) else ""
        raise TypeError(f"build_model takes a ModelConfig, got {type(config).__name__}{hint}")
    with constructing_on(device):
        model = CausalLM(config)
    if torch.device(device).type != "meta":
        init_weights(model, seed=seed)
    return model
