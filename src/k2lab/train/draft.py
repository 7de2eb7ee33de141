"""Training an EAGLE-style draft (EAGLE-1, Li et al. 2024) for a frozen target: the target's MTP module (or a
fresh one-block module when it has none) learns to continue the target's own features and tokens.

Data: prompts are windows of a corpus; the target continues each (greedy, or sampled at ``temperature``),
so the draft learns what the target says, not what the corpus says. One forward of the target over prompt +
continuation gives its final-normed hidden states h [N, T, D] (the pool, computed once). Entry i of the
draft pairs h_i with the next token x_{i+1} (teacher forcing, optionally with uniform feature noise):

    f'_i = final_norm(MTP(h_i + ε, Emb(x_{i+1})))                     ε ~ U(−noise, noise)
    L = reg_weight · SmoothL1(f'_i, h_{i+1}) + ce_weight · CE(lm_head(f'_i), x_{i+2})

with the regression on every entry and the CE on the target's generated tokens only. With a reduced draft
vocabulary S (``draft_vocab``: the N most frequent of the pool's next tokens, ``k2lab.infer.draft_vocab``)
the CE is a softmax over S alone (h W_Sᵀ), on the labels inside S; top-1 still counts every label. ``continuation = 0``
skips generation (EAGLE-1's own setting: fixed text, the target's features): the corpus windows are the
sequences and the CE labels are the target's greedy next tokens at every position. Only the module trains
(AdamW); embedding and head stay the target's. Acceptance is measured on held-out (validation) prompts
before and after with greedy speculative decoding; the draft is saved to ``<model>/draft/``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.data import load_tokenizer
from k2lab.data.corpus import load_corpus
from k2lab.errors import K2LabError
from k2lab.infer.draft import DRAFT_DIR, DRAFT_SUMMARY, EagleDraft, check_draft_directory, save_draft
from k2lab.infer.draft_vocab import DraftVocab, check_size, frequent_tokens
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.infer.speculative import speculative_generate
from k2lab.model_dir import load_text_model
from k2lab.models.decoder import CausalLM
from k2lab.models.init import init_weights
from k2lab.models.mtp import MultiTokenPrediction
from k2lab.train.divergence import check_finite_step
from k2lab.train.draft_config import DraftTrainConfig

Log = Callable[[str], None]
DRAFT_VOCAB = 1024  # draft_vocab None: this many tokens, or the whole vocabulary if that is smaller


def corpus_windows(
    texts: list[str], tokenizer, count: int, length: int, rng: random.Random
) -> list[list[int]]:
    """``count`` windows of ``length`` tokens at random places of the concatenated, tokenized texts."""
    ids = [token for ids in tokenizer.encode_batch(texts) for token in ids]
    if len(ids) <= length:
        raise K2LabError(f"the corpus has {len(ids)} tokens, fewer than one prompt of {length}")
    starts = [rng.randrange(len(ids) - length) for _ in range(count)]
    return [ids[s : s + length] for s in starts]


def continuation_pool(
    target: CausalLM, prompts: list[list[int]], config: DraftTrainConfig, log: Log = print, batch: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's continuations of ``prompts``: ids [N, T], its hidden states [N, T, D] and the tokens it
    says after each position, ``next_tokens`` [N, T] (−100 where unknown): its generated tokens, or with
    ``continuation = 0`` its greedy prediction at every position of the prompts themselves."""
    generation = GenerationConfig(
        max_new_tokens=max(config.continuation, 1), temperature=config.temperature, seed=config.seed
    )
    rows, hidden, following = [], [], []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        if config.continuation:
            new = generate(target, chunk, generation)
            chunk = [p + n for p, n in zip(chunk, new, strict=True)]  # no EOS set: full length
        ids = torch.tensor(chunk)
        with torch.no_grad():
            out = target(ids, output_hidden=True)
        if config.continuation:
            after = torch.full_like(ids, -100)
            after[:, config.prompt_len - 1 : -1] = ids[:, config.prompt_len :]
        else:
            after = out.logits.argmax(-1)
        rows.append(ids)
        hidden.append(out.hidden)
        following.append(after)
        log(f"pool: {start + len(chunk)} / {len(prompts)} sequences")
    return torch.cat(rows), torch.cat(hidden), torch.cat(following)


def draft_loss(
    target: CausalLM,
    module: MultiTokenPrediction,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    next_tokens: torch.Tensor,
    config: DraftTrainConfig,
    vocab: DraftVocab | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE-1's loss on ids [B, T], the target's hidden [B, T, D] and next tokens [B, T] (module docstring):
    entry i predicts the target's token after position i + 1, ``next_tokens[:, i + 1]``; with ``vocab`` the
    CE is over its tokens only."""
    B, T = ids.shape
    features = hidden[:, :-1]
    if config.feature_noise:
        features = features + (torch.rand_like(features) * 2 - 1) * config.feature_noise
    inputs = target.layer_inputs(B, T - 1, ids.device)
    out = module.final_norm(module(features, target.embed(ids[:, 1:]), inputs))  # f'_i, i = 0 … T−2
    regression = F.smooth_l1_loss(out.float(), hidden[:, 1:].float())
    labels = next_tokens[:, 1:]
    known = labels != -100
    ce, top1 = _token_loss(target, out[known], labels[known], vocab)
    loss = config.reg_weight * regression + config.ce_weight * ce
    values = {"loss": loss, "reg": regression, "ce": ce, "top1": top1}
    return loss, {key: value.item() for key, value in values.items()}


def _token_loss(
    target: CausalLM, features: torch.Tensor, labels: torch.Tensor, vocab: DraftVocab | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, top-1 agreement) of the draft head on features [n, D] against labels [n]: over the whole
    vocabulary, or with ``vocab`` a CE over S on the labels inside S and top-1 over all labels."""
    if vocab is None:
        logits = target.lm_head(features)
        return F.cross_entropy(logits.float(), labels), (logits.argmax(-1) == labels).float().mean()
    logits = vocab.sub_logits(target.lm_head, features)
    positions = vocab.positions(labels)
    inside = positions >= 0
    ce = F.cross_entropy(logits[inside].float(), positions[inside]) if inside.any() else logits.sum() * 0
    return ce, (logits.argmax(-1) == positions).float().mean()


def draft_vocab(
    config: DraftTrainConfig, vocab_size: int, next_tokens: torch.Tensor | None
) -> DraftVocab | None:
    """The draft's vocabulary: the ``config.draft_vocab`` (default ``DRAFT_VOCAB``, at most V) most frequent
    of the target's next tokens [N, T] (−100 ignored); None when that is the whole vocabulary. With
    ``next_tokens`` None it only checks the size (``K2LabError`` unless 1 ≤ N ≤ V)."""
    size = config.draft_vocab or min(DRAFT_VOCAB, vocab_size)
    check_size(size, vocab_size)
    if next_tokens is None or size == vocab_size:
        return None
    return DraftVocab(frequent_tokens(next_tokens, vocab_size, size), vocab_size)


def held_out_coverage(target: CausalLM, vocab: DraftVocab | None, prompts: list[list[int]]) -> float:
    """The fraction of the target's greedy next tokens on ``prompts`` (one forward) inside ``vocab``."""
    if vocab is None or not prompts:
        return 1.0 if prompts else float("nan")
    with torch.no_grad():
        return vocab.coverage(target(torch.tensor(prompts)).logits.argmax(-1))


def draft_module(target: CausalLM, fresh: bool, seed: int) -> MultiTokenPrediction:
    """The model's first MTP module, or a fresh one initialised like a model's layers."""
    if len(target.mtp) and not fresh:
        return target.mtp[0]
    holder = nn.Module()
    holder.config = target.config  # init_weights reads the initializer range from it
    holder.module = MultiTokenPrediction(target.config, 1)
    init_weights(holder, seed=seed)
    return holder.module


def acceptance(
    target: CausalLM,
    module: MultiTokenPrediction,
    prompts: list[list[int]],
    config: DraftTrainConfig,
    vocab: DraftVocab | None = None,
) -> float:
    """Tokens per target forward of greedy speculative decoding on ``prompts`` (EAGLE's τ)."""
    if not prompts:
        return float("nan")
    module.eval()
    generation = GenerationConfig(max_new_tokens=config.eval_tokens)
    _, stats = speculative_generate(
        target, EagleDraft(target, module, vocab), prompts, generation, num_draft_tokens=config.draft_tokens
    )
    return stats.tokens_per_step


def check_context(config: DraftTrainConfig, context: int) -> None:
    """``K2LabError`` when a training sequence (a prompt and its continuation) or a held-out check (a prompt
    and its new tokens) would run past the target's ``context`` (``max_position_embeddings``): the draft
    would learn the target's features at positions it was never trained on."""
    for what, tokens in (("continuation", config.continuation), ("eval_tokens", config.eval_tokens)):
        if config.prompt_len + tokens > context:
            raise K2LabError(
                f"prompt_len {config.prompt_len} + {what} {tokens} = {config.prompt_len + tokens} tokens "
                f"exceed the model's context of {context} (max_position_embeddings); lower them"
            )


def train_draft(config: DraftTrainConfig, log: Log = print) -> dict[str, float]:
    """Fine-tune (or train) the draft of ``config.model`` and save it; returns the summary it writes."""
    started = time.perf_counter()
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    out = config.out or config.model / DRAFT_DIR
    check_draft_directory(out, config.model)  # before any work: the draft replaces the whole directory
    if not (config.model / "tokenizer.json").is_file():
        raise K2LabError(f"{config.model} has no tokenizer.json: the prompts are corpus text")
    tokenizer = load_tokenizer(config.model / "tokenizer.json")
    target = load_text_model(config.model, "draft training")
    draft_vocab(config, target.config.vocab_size, None)  # a bad size fails before any work
    check_context(config, target.config.max_position_embeddings)
    target.eval().requires_grad_(False)
    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes)
    train = corpus_windows([d.text for d in corpus.train], tokenizer, config.prompts, config.prompt_len, rng)
    held_out = corpus.val or corpus.train
    val = corpus_windows(
        [d.text for d in held_out], tokenizer, config.eval_prompts or 1, config.prompt_len, rng
    )
    val = val[: config.eval_prompts]
    module = draft_module(target, config.fresh, config.seed)
    before = acceptance(target, module, val, config)
    log(f"held-out tokens per step before: {before:.3f}; the target continues {len(train)} prompts")
    ids, hidden, next_tokens = continuation_pool(target, train, config, log)
    vocab = draft_vocab(config, target.config.vocab_size, next_tokens)
    coverage = {
        "draft_vocab": len(vocab) if vocab else target.config.vocab_size,
        "vocab_coverage_train": vocab.coverage(next_tokens) if vocab else 1.0,
        "vocab_coverage_held_out": held_out_coverage(target, vocab, val),
    }
    log("draft vocabulary: " + ", ".join(f"{key} {value:.4g}" for key, value in coverage.items()))
    module.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * step / config.steps))
    )
    metrics: dict[str, float] = {}
    first: dict[str, float] = {}
    for step in range(1, config.steps + 1):
        rows = torch.tensor([rng.randrange(ids.shape[0]) for _ in range(config.batch_size)])
        loss, metrics = draft_loss(target, module, ids[rows], hidden[rows], next_tokens[rows], config, vocab)
        first = first or {f"first_{key}": value for key, value in metrics.items()}
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0))
        check_finite_step(step, float(loss.detach()), norm, config.lr, None)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == config.steps:
            log(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    module.requires_grad_(False)
    after = acceptance(target, module, val, config, vocab)
    summary = {
        "tokens_per_step_before": before,
        "tokens_per_step_after": after,
        **coverage,
        **metrics,
        **first,
        "seconds": time.perf_counter() - started,
    }
    info = {"training": config.model_dump(mode="json"), "summary": summary}
    save_draft(module, target.config, out, info, vocab)
    (out / DRAFT_SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    log(f"held-out tokens per step after: {after:.3f}; draft saved to {out}")
    return summary
