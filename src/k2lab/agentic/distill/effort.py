"""K3's multi-effort RL: three domains × three effort levels → nine expert policies, one RL run each.

Effort is chosen through the system prompt. ``EffortEnv(domain, effort)`` wraps a domain environment
(``build_env(domain)`` under ``GuardedEnv``) and, on ``reset``,

* prepends the system message ``"Reasoning effort: {effort}"`` (before the task's own system prompt),
* sets ``episode.token_budget = B_effort`` (the RL loop's budget penalty then applies), and
* records ``state["domain"]`` / ``state["effort"]`` (MOPD routes each prompt to its teacher with them).

The policy may generate up to ``max_new_tokens = 2 · B`` per turn: the budget penalty of
``k2lab.agentic.rl.trainer``

    r_j = R_env(y_j) − λ · min(1, max(0, n_j − B) / B)

saturates at n_j = 2B, so longer answers cannot be worse, only truncated. Default budgets (new tokens):
low 16, high 48, max 128.

``train_experts`` trains the nine experts from one SFT checkpoint with ``RLTrainer`` (the K1.5 objective,
MuonClip, exact resume), each in ``OUT/{domain}-{effort}`` with its policy in ``OUT/{domain}-{effort}/model``;
``OUT/experts.json`` is the manifest: the experts, the source checkpoint (resolved) and the RL settings they
are trained with. A finished expert (its ``model/`` exists) is skipped; an unfinished one resumes from its own
checkpoints. A rerun into the same directory must therefore train the same experts from the same checkpoint
with the same RL settings: one that differs from the manifest is refused before anything is written, naming
the differences. Only checkpointing and the step timeout (``EXPERT_RERUN_CHANGES``) may change; more
``--iterations`` is refused too, since finished experts would be skipped rather than trained further while
the manifest claimed the new count.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.agentic.rl.envs import GuardedEnv, build_env, check_env_name
from k2lab.agentic.rl.trainer import RLTrainer, iteration_report
from k2lab.data import load_tokenizer
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import atomic_write_text, read_json_object
from k2lab.model_dir import load_text_model, save_model
from k2lab.train.persistence import check_resumed_config
from k2lab.train.resume import flat_settings

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_DOMAINS",
    "EFFORTS",
    "EXPERT_RERUN_CHANGES",
    "EXPERT_RL_DEFAULTS",
    "EffortEnv",
    "ExpertSpec",
    "expert_specs",
    "load_manifest",
    "train_experts",
]

EFFORTS = ("low", "high", "max")
DEFAULT_DOMAINS = ("arithmetic", "instruction", "coding")
DEFAULT_BUDGETS = {"low": 16, "high": 48, "max": 128}
# RLConfig values of the experts' runs (``k2lab mopd experts``) where they differ from RLConfig's own
EXPERT_RL_DEFAULTS = {"keep_checkpoints": 2}
MANIFEST = "experts.json"
# RLConfig fields a rerun into an experts directory may change: they change neither what an expert learns nor
# which experts count as finished (not ``iterations``: a finished expert is skipped, not trained further)
EXPERT_RERUN_CHANGES = frozenset({"checkpoint_every", "keep_checkpoints", "step_timeout_s"})


def effort_prompt(effort: str) -> str:
    """The system prompt that selects an effort level."""
    return f"Reasoning effort: {effort}"


@dataclass(frozen=True)
class ExpertSpec:
    """One cell of the domain × effort grid: its token budget B and the per-turn limit 2B."""

    domain: str
    effort: str
    budget: int

    @property
    def key(self) -> str:
        """``{domain}-{effort}`` with ``:`` of a domain like ``mini-tools:files`` as ``.`` (a directory name)."""
        return f"{self.domain.replace(':', '.')}-{self.effort}"

    @property
    def max_new_tokens(self) -> int:
        return 2 * self.budget


def expert_specs(
    domains: Sequence[str] = DEFAULT_DOMAINS, budgets: dict[str, int] | None = None
) -> list[ExpertSpec]:
    """The grid, domain-major: (d₁, low), (d₁, high), (d₁, max), (d₂, low) ...

    Checked before any expert trains (``ValueError``): at least one domain, each known to ``build_env`` and
    named once; budgets of known effort levels, positive and strictly increasing with the effort."""
    budgets = budgets or DEFAULT_BUDGETS
    _check_domains(domains)
    _check_budgets(budgets)
    return [ExpertSpec(d, e, int(budgets[e])) for d in domains for e in EFFORTS if e in budgets]


def _check_domains(domains: Sequence[str]) -> None:
    """At least one domain, each an environment name ``build_env`` knows, none twice."""
    if not domains:
        raise ValueError("no domains: name at least one environment (say arithmetic)")
    for domain in domains:
        check_env_name(domain)
    repeated = sorted({d for d in domains if list(domains).count(d) > 1})
    if repeated:
        raise ValueError(f"domains named twice: {', '.join(repeated)}")


def _check_budgets(budgets: dict[str, int]) -> None:
    """Known effort levels with positive token budgets, strictly increasing in ``EFFORTS`` order."""
    unknown = set(budgets) - set(EFFORTS)
    if unknown:
        raise ValueError(f"unknown effort levels {sorted(unknown)}; use {EFFORTS}")
    ordered = [(effort, budgets[effort]) for effort in EFFORTS if effort in budgets]
    if any(budget < 1 for _, budget in ordered):
        raise ValueError(f"token budgets must be positive (got {dict(ordered)})")
    if any(low >= high for (_, low), (_, high) in pairwise(ordered)):
        shown = " < ".join(effort for effort, _ in ordered)
        raise ValueError(f"token budgets must increase with the effort, {shown} (got {dict(ordered)})")


class EffortEnv(Environment):
    """A domain environment at one effort level: effort system prompt + token budget (see module doc)."""

    def __init__(self, spec: ExpertSpec, env: Environment | None = None, timeout_s: float = 30.0) -> None:
        self.spec = spec
        self.env = GuardedEnv(env or build_env(spec.domain), timeout_s)
        self.name = spec.key

    def reset(self, seed: int) -> Episode:
        episode = self.env.reset(seed)
        episode.env = self.name
        episode.messages.insert(0, {"role": "system", "content": effort_prompt(self.spec.effort)})
        episode.token_budget = self.spec.budget
        episode.state["domain"], episode.state["effort"] = self.spec.domain, self.spec.effort
        return episode

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        self.env.step(episode, message)
        episode.env = self.name


# ------------------------------------------------------------------------------------------ training


def load_manifest(directory: str | Path) -> dict[str, Any]:
    """``experts.json`` of an experts directory (specs, SFT checkpoint, RL config); a missing or unreadable
    one, or one without its list of experts, is a one-line ``K2LabError`` naming the file."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise K2LabError(f"{directory} has no {MANIFEST}: train experts with `k2lab mopd experts` first")
    manifest = read_json_object(path)
    experts = manifest.get("experts")
    fields = {"domain", "effort", "budget"}
    if not isinstance(experts, list) or not all(isinstance(e, dict) and set(e) == fields for e in experts):
        raise CheckpointError(
            f"{path} is not an experts manifest: it needs a list of {{domain, effort, budget}}"
        )
    return manifest


def manifest_specs(manifest: dict[str, Any]) -> list[ExpertSpec]:
    return [ExpertSpec(**spec) for spec in manifest["experts"]]


def train_expert(
    checkpoint: str | Path,
    spec: ExpertSpec,
    out_dir: str | Path,
    config: Any,
    env: Environment | None = None,
    log: Callable[[str], object] | None = None,
) -> Path:
    """RL one expert (``run_rl`` with its ``EffortEnv``); returns its policy directory ``OUT/model``.

    ``config`` is an ``RLConfig``; its ``envs`` and ``max_new_tokens`` are set from ``spec``. ``log`` gets a
    line per iteration (``iteration_report``).
    """
    out = Path(out_dir)
    config = config.model_copy(update={"envs": [spec.domain], "max_new_tokens": spec.max_new_tokens})
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(Path(checkpoint) / "tokenizer.json")
    model = load_text_model(checkpoint, "multi-effort RL")
    trainer = RLTrainer(model, tokenizer, config, out, env=EffortEnv(spec, env, config.step_timeout_s))
    trainer.run(on_iteration=None if log is None else lambda m: log(iteration_report(m, config.iterations)))
    save_model(model, out / "model")
    tokenizer.save(out / "model" / "tokenizer.json")
    return out / "model"


def train_experts(
    checkpoint: str | Path,
    out_dir: str | Path,
    config: Any,
    specs: Sequence[ExpertSpec] | None = None,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Train every expert of ``specs`` (default: the 3 × 3 grid) from ``checkpoint``; resumable.

    Each expert's RL seed is ``config.seed`` + its index, so experts see different prompts. A rerun whose
    experts, checkpoint or RL settings differ from ``OUT/experts.json`` is refused (``check_rerun``) before
    the manifest is written; returns it.
    """
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if not (checkpoint / "tokenizer.json").is_file():
        raise K2LabError(f"{checkpoint} has no tokenizer.json: RL renders chats with the model's tokenizer")
    specs = list(specs or expert_specs())
    for spec in specs:  # before the first expert trains, not when the bad one's turn comes
        check_env_name(spec.domain)
    manifest = {
        "checkpoint": str(checkpoint.resolve()),
        "experts": [vars(s) for s in specs],
        "rl": config.model_dump(mode="json"),
    }
    if (out / MANIFEST).is_file():
        check_rerun(load_manifest(out), manifest, out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    for index, spec in enumerate(specs):
        if (out / spec.key / "model" / "tokenizer.json").is_file():
            log(f"{spec.key}: done, skipped")
            continue
        log(f"{spec.key}: RL, budget {spec.budget}, {config.iterations} iterations")
        seeded = config.model_copy(update={"seed": config.seed + index})
        train_expert(
            checkpoint, spec, out / spec.key, seeded, log=lambda line, key=spec.key: log(f"{key}: {line}")
        )
    return manifest


def check_rerun(saved: dict[str, Any], manifest: dict[str, Any], out: Path) -> None:
    """Refuse (one line) a rerun into ``out`` whose experts, source checkpoint or RL settings differ from the
    saved manifest's; only ``EXPERT_RERUN_CHANGES`` may differ (a manifest without them checks what it has)."""
    if saved["experts"] != manifest["experts"]:
        raise K2LabError(f"{out} holds experts of other domains or budgets: choose another --out")
    check_resumed_config(_trained_with(saved), _trained_with(manifest), out, EXPERT_RERUN_CHANGES)


def _trained_with(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest's RL settings (nested ones as ``optimizer.lr``) and its source checkpoint (resolved) as one
    flat dict, so a refusal names just the fields that changed."""
    settings = flat_settings(manifest["rl"]) if isinstance(manifest.get("rl"), dict) else {}
    if isinstance(manifest.get("checkpoint"), str):
        settings["checkpoint"] = str(Path(manifest["checkpoint"]).resolve())
    return settings
