"""Drafts for speculative decoding: the ``Draft`` protocol, a small causal LM as draft, and the EAGLE-style
draft that runs an MTP block on the target's own hidden states (feature-level autoregression).

Notation: the target's cache holds x_1 … x_m and the *pending* token x_{m+1} (sampled, not yet fed).
A step proposes d_1 … d_k, the target verifies [x_{m+1}, d_1 … d_k] in one forward, accepts d_1 … d_a and
adds its own token t' (``k2lab.infer.speculative``); every draft is then told ``accept(a, t', hidden)``.

``ModelDraft`` (any ``CausalLM`` with the target's vocabulary) keeps its own latent cache holding everything
but the last two tokens [u, t] (u the last token in the target's cache, t pending). ``propose`` feeds
[u, t], then d_1 … d_{k−1}: k + 1 tokens in k forwards; ``accept`` keeps the first a + 1 of them, so the
invariant holds again with u' = d_a (t when a = 0) and t' pending: the same rollback as the target's.

``EagleDraft`` (EAGLE-1, Li et al. 2024, on DeepSeek-V3's MTP module): entry i of its one-layer cache is

    f'_i = MTP(f_i, Emb(x_{i+1})),   P(x_{i+2}) = softmax(lm_head(f'_i)),   f'_i = final_norm(h^1_i)

with f_i the target's final-normed hidden state h_i for context tokens and the draft's own output f'_{i−1}
inside a proposal (``propose``: k − 1 forwards of one entry). ``accept`` drops the k − 1 drafted entries and
feeds the a + 1 verified ones (h of x_{m+1}, d_1 … d_a from the verify forward, paired with the next token),
whose last output gives d_1 of the next step: k forwards of the draft block per step, and k heads (only
on the entries that propose). With a ``DraftVocab`` the head is the lm_head's rows of N frequent tokens
(logits −∞ elsewhere; ``k2lab.infer.draft_vocab``), saved with the draft.

Compiled drafts (``Draft.compile``, which ``SpeculativeStep`` calls with its ``GenerationConfig.compile``): a
``ModelDraft`` proposes through its model's compiled decode step, an ``EagleDraft`` through one compiled graph
per forward (``EagleForward``: the entries' rotary inputs and mask, the block, the cache's commit, the final
norm and the full head), both by ``k2lab.infer.compiled.decode_step``; the prompt's prefill stays eager. A
k2-mini draft forward with its full head took 1.8 ms eager and 0.5 ms compiled within a speculative step at
batch 1 (0.17 ms alone: the verify forward before it evicts the draft's weights; docs/generation.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from k2lab.config import ModelConfig, format_validation_error
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import (
    check_format_version,
    check_replaceable,
    read_json_object,
    save_tensors,
    staged_directory,
)
from k2lab.hardware import Precision
from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import CompileMode, decode_step, reads_bf16
from k2lab.infer.decode_weights import bf16_twin
from k2lab.infer.draft_vocab import DraftVocab
from k2lab.infer.rollback import CacheWindow, ensure_room
from k2lab.model_dir import check_state_dict
from k2lab.models.decoder import CausalLM
from k2lab.models.mtp import MultiTokenPrediction
from k2lab.nn.decode_linear import decode_linear

DRAFT_DIR = "draft"  # <model dir>/draft/: the EAGLE draft trained for that model (``k2lab draft train``)
DRAFT_FORMAT = "k2lab-draft"
DRAFT_MANIFEST = "k2lab-draft.json"
DRAFT_WEIGHTS = "draft.safetensors"
DRAFT_SUMMARY = "summary.json"  # written beside the draft by ``k2lab draft train``
DRAFT_FILES = frozenset({DRAFT_MANIFEST, DRAFT_WEIGHTS, DRAFT_SUMMARY})  # all that a draft directory holds
DRAFT_VERSION = 1
DRAFT_KINDS = ("eagle",)
VOCAB_KEY = "draft_vocab.ids"  # a reduced draft vocabulary's token ids [N] (``k2lab.infer.draft_vocab``)
# what a draft must share with its target (the block's shapes, the shared embedding and head)
_MATCHING = ("vocab_size", "hidden_size", "kv_lora_rank", "qk_rope_head_dim", "num_attention_heads")

Pick = Callable[[torch.Tensor], torch.Tensor]  # draft logits [B, V] -> chosen tokens [B]


class Draft(Protocol):
    """What speculative decoding asks of a draft (all tensors on the target's device)."""

    uses_hidden: bool  # True: prefill and accept need the target's final-normed hidden states

    def prefill(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        pending: torch.Tensor,
        hidden: torch.Tensor | None,
        capacity: int,
    ) -> None:
        """The target prefilled left-padded ids [B, T] (valid [B, T]; hidden [B, T, D]) and sampled pending
        [B]; ``capacity`` bounds the live tokens of any row (prompt + new tokens + a window)."""

    def propose(self, num_tokens: int, pick: Pick) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k tokens autoregressively, choosing each with ``pick``: (tokens [B, k], logits [B, k, V])."""

    def accept(self, accepted: torch.Tensor, pending: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Row b kept its first accepted[b] drafted tokens and the target added pending[b]; hidden [B, k+1, D]
        is the verify forward's (positions x_{m+1}, d_1 … d_k)."""

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order)."""

    def concat(self, other: Draft) -> None:
        """Append the rows of ``other`` (the same kind of draft, prefilled on another batch) after these."""

    def compile(self, requested: CompileMode | str, weights: Precision | str = "fp32") -> None:
        """Run the proposing forwards compiled or eager, per ``k2lab.infer.compiled.decode_step``; compiled on
        CPU, their matrices read in the dtype ``weights`` resolves to (``k2lab.infer.decode_weights``)."""


def _concat_caches(first: LatentCache, second: LatentCache) -> LatentCache:
    """Both caches' rows in one, keeping the larger free room of the two after the longer."""
    room = max(first.max_length - first.length, second.max_length - second.length)
    return LatentCache.concat([first, second], max(first.length, second.length) + room)


def _model_dtype(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device


class ModelDraft:
    """An independent (small) causal LM as the draft; see the module docstring for its cache invariant."""

    uses_hidden = False

    def __init__(self, model: CausalLM) -> None:
        self.model = self.run = model  # run: the proposing forward (compiled by ``compile``)
        self.cache: LatentCache | None = None

    def compile(self, requested: CompileMode | str, weights: Precision | str = "fp32") -> None:
        self.run = decode_step(self.model, requested, weights)

    def prefill(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        pending: torch.Tensor,
        hidden: torch.Tensor | None,
        capacity: int,
    ) -> None:
        dtype, device = _model_dtype(self.model)
        self.cache = LatentCache(self.model.config, ids.shape[0], capacity, dtype=dtype, device=device)
        if ids.shape[1] > 1:  # a left-padded batch: the last column is real in every row
            self.model(ids[:, :-1], attention_mask=valid[:, :-1], cache=self.cache)
        self.last, self.pending = ids[:, -1], pending

    def propose(self, num_tokens: int, pick: Pick) -> tuple[torch.Tensor, torch.Tensor]:
        ensure_room(self.cache, num_tokens + 1)
        self.window = CacheWindow(self.cache)
        feed = torch.stack([self.last, self.pending], dim=1)
        tokens, logits = [], []
        for _ in range(num_tokens):
            step = self.run(feed, cache=self.cache).logits[:, -1]
            tokens.append(pick(step))
            logits.append(step)
            feed = tokens[-1][:, None]
        self.drafted = torch.stack(tokens, dim=1)
        return self.drafted, torch.stack(logits, dim=1)

    def accept(self, accepted: torch.Tensor, pending: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.window.close(accepted + 1)
        chain = torch.cat([self.pending[:, None], self.drafted], dim=1)
        self.last = chain.gather(1, accepted[:, None]).squeeze(1)
        self.pending = pending

    def select(self, index: torch.Tensor) -> None:
        self.cache.select(index)
        self.last, self.pending = self.last[index], self.pending[index]

    def concat(self, other: ModelDraft) -> None:
        self.cache = _concat_caches(self.cache, other.cache)
        self.last, self.pending = torch.cat([self.last, other.last]), torch.cat([self.pending, other.pending])


def single_layer_config(model: CausalLM):
    """The target's config reduced to one MLA layer: the shape of an MTP block's latent cache."""
    return model.config.replace(
        num_hidden_layers=1,
        mla_layers=None,
        first_k_dense_replace=1,
        moe_latent_size=None,
        attnres_block_size=None,
        num_nextn_predict_layers=0,
    )


class EagleForward(nn.Module):
    """One forward of an EAGLE draft, as a module so that it compiles as one graph: entries (features
    [B, T, D], tokens [B, T], valid [B, T] or None: all real) appended to ``cache`` -> (f' [B, D] of each
    row's entry ``index`` [B] (None: the last), its logits [B, V] through the shared lm_head, or None when
    ``full_head`` is False and the caller applies a reduced one)."""

    def __init__(self, target: CausalLM, module: MultiTokenPrediction, full_head: bool) -> None:
        super().__init__()
        self.target, self.module, self.full_head = target, module, full_head

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        valid: torch.Tensor | None,
        index: torch.Tensor | None,
        cache: LatentCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = tokens.shape
        inputs = self.target.layer_inputs(B, T, features.device, attention_mask=valid, cache=cache)
        h = self.module(features, self.target.embed(tokens), inputs, cache.layer(0))
        cache.commit(inputs.valid, T)
        h = h[:, -1] if index is None else h[torch.arange(B, device=h.device), index]
        feature = self.module.final_norm(h)  # f' of the one entry per row that proposes next
        return feature, decode_linear(feature, self.target.lm_head.weight) if self.full_head else None


class EagleDraft:
    """EAGLE-style draft: ``module`` (a ``MultiTokenPrediction``) on ``target``'s features, sharing its
    embedding and lm_head (see the module docstring)."""

    uses_hidden = True

    def __init__(
        self, target: CausalLM, module: MultiTokenPrediction, vocab: DraftVocab | None = None
    ) -> None:
        self.target, self.module, self.vocab = target, module, vocab
        self.eager = self.run = EagleForward(target, module, full_head=vocab is None)
        self.cache: LatentCache | None = None
        self._bf16: EagleForward | None = None  # the forward over the target's and the block's bf16 twins

    def compile(self, requested: CompileMode | str, weights: Precision | str = "fp32") -> None:
        """As the protocol says. With bf16 weights the compiled forward is an ``EagleForward`` over
        ``bf16_twin(target)`` and ``bf16_twin(module)`` (the target's twin is the one its own compiled step
        runs, so the target's matrices are not copied again; kept while both twins stay the same objects)."""
        forward = self.eager
        if reads_bf16(requested, weights, next(self.target.parameters()).device.type):
            target, module = bf16_twin(self.target), bf16_twin(self.module)
            if self._bf16 is None or (self._bf16.target, self._bf16.module) != (target, module):
                self._bf16 = EagleForward(target, module, full_head=self.eager.full_head)
            forward = self._bf16
        self.run = decode_step(forward, requested)

    def _advance(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries appended by ``forward`` (default ``run``; ``EagleForward``'s arguments) -> (f' [B, D] of
        entry ``index`` per row, its logits [B, V]: the full head's from the forward, or over ``vocab`` only)."""
        feature, logits = (forward or self.run)(features, tokens, valid, index, self.cache)
        if self.vocab is not None:
            logits = self.vocab.logits(self.target.lm_head, feature)
        return feature, logits

    def prefill(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        pending: torch.Tensor,
        hidden: torch.Tensor | None,
        capacity: int,
    ) -> None:
        dtype, device = _model_dtype(self.module)
        config = single_layer_config(self.target)
        self.cache = LatentCache(config, ids.shape[0], capacity, dtype=dtype, device=device)
        tokens = torch.cat([ids[:, 1:], pending[:, None]], dim=1)  # entry i pairs h_i with x_{i+1}
        # the last column is real in every row; the prompt's forward stays eager (its shapes vary most)
        self.feature, self.next_logits = self._advance(hidden, tokens, valid, forward=self.eager)

    def propose(self, num_tokens: int, pick: Pick) -> tuple[torch.Tensor, torch.Tensor]:
        ensure_room(self.cache, num_tokens)
        self.window = CacheWindow(self.cache)
        tokens, logits = [pick(self.next_logits)], [self.next_logits]
        feature = self.feature
        for _ in range(num_tokens - 1):
            feature, step = self._advance(feature[:, None], tokens[-1][:, None])
            tokens.append(pick(step))
            logits.append(step)
        self.drafted = torch.stack(tokens, dim=1)
        return self.drafted, torch.stack(logits, dim=1)

    def accept(self, accepted: torch.Tensor, pending: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.window.close(torch.zeros_like(accepted))  # entries on drafted features go
        width = self.drafted.shape[1] + 1
        ensure_room(self.cache, width)
        tokens = torch.cat([self.drafted, pending[:, None]], dim=1)
        tokens = tokens.scatter(1, accepted[:, None], pending[:, None])  # entry a pairs h with t'
        valid = torch.arange(width, device=hidden.device)[None, :] <= accepted[:, None]
        # the head on the one entry that proposes next
        self.feature, self.next_logits = self._advance(hidden[:, :width], tokens, valid, accepted)

    def select(self, index: torch.Tensor) -> None:
        self.cache.select(index)
        self.feature, self.next_logits = self.feature[index], self.next_logits[index]

    def concat(self, other: EagleDraft) -> None:
        self.cache = _concat_caches(self.cache, other.cache)
        self.feature = torch.cat([self.feature, other.feature])
        self.next_logits = torch.cat([self.next_logits, other.next_logits])


def save_draft(
    module: MultiTokenPrediction,
    config: ModelConfig,
    directory: str | os.PathLike[str],
    info: dict[str, Any] | None = None,
    vocab: DraftVocab | None = None,
) -> Path:
    """Write an EAGLE draft (``module``'s weights; embedding and head stay the target's) to ``directory``
    atomically: ``k2lab-draft.json`` {format, version, kind: "eagle", config: the target's ModelConfig,
    draft_vocab: N or null, info} and ``draft.safetensors`` (with a reduced vocabulary, its ids [N] under
    ``draft_vocab.ids``). ``save_model`` over the model directory replaces ``draft/`` too. The whole
    directory is replaced, so it must be new, empty or an earlier draft (``check_draft_directory``)."""
    target = Path(directory)
    check_draft_directory(target)
    with staged_directory(target) as staging:
        manifest = {
            "format": DRAFT_FORMAT,
            "version": DRAFT_VERSION,
            "kind": "eagle",
            "config": config.model_dump(mode="json"),
            "draft_vocab": None if vocab is None else len(vocab),
            "info": info or {},
        }
        (staging / DRAFT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        state = {key: value.detach().contiguous() for key, value in module.state_dict().items()}
        if vocab is not None:
            state[VOCAB_KEY] = vocab.ids.cpu().contiguous()
        save_tensors(state, staging / DRAFT_WEIGHTS, metadata={"format": DRAFT_FORMAT})
    return target


def is_draft_directory(directory: Path) -> bool:
    """Whether ``directory`` holds an earlier draft and nothing else: a ``k2lab-draft.json`` that is a JSON
    object of format ``k2lab-draft``, among no entries but ``DRAFT_FILES``."""
    try:
        manifest = json.loads((directory / DRAFT_MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("format") == DRAFT_FORMAT
        and {entry.name for entry in directory.iterdir()} <= DRAFT_FILES
    )


def check_draft_directory(target: Path, model: Path | None = None) -> None:
    """Refuse (one-line ``CheckpointError``) to write a draft at ``target`` where that would lose anything:
    ``save_draft`` replaces the whole directory, so ``target`` must be new, empty or an earlier draft
    (``is_draft_directory``), and must not be the ``model`` or hold it. ``--out MODEL`` replaced the model's
    weights, its manifest and its tokenizer with the draft."""
    check_replaceable(target, "the draft", model, is_draft_directory, "draft", source_name="model")


def load_draft(directory: str | os.PathLike[str], target: CausalLM) -> EagleDraft:
    """The EAGLE draft saved in ``directory`` for ``target`` (``CheckpointError`` if it does not fit)."""
    path = Path(directory)
    manifest = read_json_object(path / DRAFT_MANIFEST)
    if manifest.get("format") != DRAFT_FORMAT:
        raise CheckpointError(
            f"{path / DRAFT_MANIFEST}: format is {manifest.get('format')!r}, expected {DRAFT_FORMAT!r}"
        )
    _check_draft_manifest(manifest, path / DRAFT_MANIFEST)
    saved = manifest["config"]
    if wrong := _differences(saved, target.config):
        raise CheckpointError(f"the draft in {path} was trained for another model: {', '.join(wrong)}")
    try:
        state = load_file(str(path / DRAFT_WEIGHTS))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{path / DRAFT_WEIGHTS} cannot be read ({error})") from error
    param = next(target.parameters())
    vocab = _saved_vocab(state.pop(VOCAB_KEY, None), manifest.get("draft_vocab"), target, path)
    try:
        config = ModelConfig.model_validate(saved)
    except ValidationError as error:
        raise CheckpointError(
            f"{path / DRAFT_MANIFEST}: invalid config: {format_validation_error(error)}"
        ) from error
    module = MultiTokenPrediction(config, 1).to(param.device)
    check_state_dict(module, state, str(path / DRAFT_WEIGHTS))
    module.load_state_dict(state)
    return EagleDraft(target, module.to(param.dtype).eval(), vocab)


def _differences(saved: dict[str, Any], config: ModelConfig) -> list[str]:
    """The ``_MATCHING`` settings where a draft's model (``saved``, a config's JSON) differs from ``config``."""
    return [
        f"{key} {saved.get(key)} != {getattr(config, key)}"
        for key in _MATCHING
        if saved.get(key) != getattr(config, key)
    ]


def check_draft(target: CausalLM, draft: Draft) -> None:
    """``K2LabError`` (one line) unless ``draft`` can draft for ``target``: a ``ModelDraft``'s model has the
    target's vocabulary (its ids index the target's embedding), an ``EagleDraft``'s model matches the target
    in ``_MATCHING`` and its MTP module is the block that model builds (``_module_mismatch``). Other drafts
    are not checked. ``speculative_generate`` and ``k2lab serve``'s ``Speculation`` call it, once per draft
    (not per ``SpeculativeStep``: serve builds one for every admitted batch)."""
    if isinstance(draft, ModelDraft):
        theirs, ours = draft.model.config.vocab_size, target.config.vocab_size
        if theirs != ours:
            raise K2LabError(
                f"the draft model's vocabulary has {theirs} tokens, the target's {ours}: a draft must share "
                "the target's vocabulary"
            )
    elif isinstance(draft, EagleDraft):
        if wrong := _differences(draft.target.config.model_dump(mode="json"), target.config):
            raise K2LabError(
                f"the EAGLE draft was built on another model than the target: {', '.join(wrong)}"
            )
        if wrong := _module_mismatch(draft.module, draft.target.config):
            raise K2LabError(f"the EAGLE draft's MTP module does not fit the target: {wrong}")


def _module_mismatch(module: nn.Module, config: ModelConfig) -> str | None:
    """The first difference between ``module`` and the MTP block ``config`` builds (built on the meta device:
    no memory): a parameter's name or shape, or whether attention is rotary (``mla_rope``, which changes no
    shape; a rotary block on a NoPE target found no rotary tables). None when they match."""
    with torch.device("meta"):
        expected = MultiTokenPrediction(config, 1)
    shapes = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    for name, value in expected.state_dict().items():
        have = shapes.pop(name, None)
        if have is None:
            return f"the target's MTP block has {name}, the module does not"
        if have != tuple(value.shape):
            return f"{name} is {have} in the module, {tuple(value.shape)} in the target's MTP block"
    if shapes:
        return f"the module has {next(iter(shapes))}, the target's MTP block does not"
    rotary = getattr(module.block.attn, "rotate", None)
    if rotary != config.mla_rope:
        return f"the module's attention is rotary: {rotary}, the target's (mla_rope): {config.mla_rope}"
    return None


def _check_draft_manifest(manifest: dict[str, Any], source: Path) -> None:
    """``CheckpointError`` unless ``manifest`` has a version this code reads, a known kind and a config
    object."""
    check_format_version(manifest, source, DRAFT_VERSION)
    kind = manifest.get("kind")
    if kind not in DRAFT_KINDS:
        raise CheckpointError(f"{source}: kind {kind!r} is unknown (expected one of {list(DRAFT_KINDS)})")
    if not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"{source}: config {manifest.get('config')!r} should be a JSON object")


def _saved_vocab(ids: torch.Tensor | None, declared: Any, target: CausalLM, path: Path) -> DraftVocab | None:
    """The reduced vocabulary stored with a draft (``ids`` [N], integers), which the manifest's
    ``draft_vocab`` (N, or null for none) must describe; ``CheckpointError`` otherwise."""
    weights = path / DRAFT_WEIGHTS
    if ids is not None and (
        ids.ndim != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool
    ):
        raise CheckpointError(
            f"{weights}: {VOCAB_KEY} {ids.dtype} {tuple(ids.shape)} should be 1-D integer ids"
        )
    held = None if ids is None else ids.numel()
    if isinstance(declared, bool) or declared != held:
        raise CheckpointError(
            f"{path / DRAFT_MANIFEST}: draft_vocab {declared!r} does not match the {held or 'no'} ids stored"
            f" in {weights}"
        )
    try:
        return None if ids is None else DraftVocab(ids, target.config.vocab_size)
    except K2LabError as error:
        raise CheckpointError(f"{weights}: {error}") from error


def find_draft(model_dir: str | os.PathLike[str], target: CausalLM) -> EagleDraft | None:
    """The draft beside a model: ``<model_dir>/draft/`` if saved, else the model's own first MTP module
    (DeepSeek-V3-format checkpoints carry one), else None."""
    if (Path(model_dir) / DRAFT_DIR / DRAFT_MANIFEST).is_file():
        return load_draft(Path(model_dir) / DRAFT_DIR, target)
    if len(target.mtp):
        return EagleDraft(target, target.mtp[0])
    return None
