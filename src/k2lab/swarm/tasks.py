"""Wide tasks: facts spread over many shards, hard to gather serially under a step budget.

Task ``seed``: "sum the sales of product P over n regional databases". Each shard holds the sales of a few
products and is reachable only through ``query_shard(shard, key)``, which answers ``"s03=41"``; an agent
may run one ``query_shard`` per step. The answer is ``Σ_{s ∈ shards} sales[s][P]``; the verifier is exact
(the last integer of the final message must equal it) and gives r_perf ∈ {0, 1}.

With a main-agent budget of B_main turns, a single agent gathers at most B_main − 1 shards (one turn is the
final answer), so every task with n ≥ B_main shards cannot be finished serially. Splits: training tasks
have even seeds, held-out tasks odd seeds (``split_seeds``), so they never overlap.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from k2lab.train.persistence import derive_seed

__all__ = ["PRODUCTS", "WideTask", "make_task", "parse_facts", "split_seeds", "verify_answer"]

PRODUCTS = ("apples", "bolts", "cables", "drills", "easels", "fans")
FACT = re.compile(r"\b(s\d{2})=(-?\d+)")


@dataclass(frozen=True)
class WideTask:
    """One task: the product asked about, the shards to combine, and every shard's database."""

    seed: int
    product: str
    shards: tuple[str, ...]
    databases: dict[str, dict[str, int]]

    @property
    def answer(self) -> int:
        return sum(self.databases[s][self.product] for s in self.shards)

    def query(self, shard: str, key: str) -> str:
        """``query_shard``: ``"sNN=value"`` (0 for a product the shard does not sell); KeyError for no shard."""
        if shard not in self.databases:
            raise KeyError(f"no shard {shard!r}")
        return f"{shard}={self.databases[shard].get(key, 0)}"

    def question(self) -> str:
        return (
            f"Sum the sales of product {self.product} over the {len(self.shards)} regional shards: "
            f"{', '.join(self.shards)}. Each shard is reachable only via query_shard(shard, key). "
            "Answer with the total."
        )


def make_task(seed: int, min_shards: int = 3, max_shards: int = 16) -> WideTask:
    """Task ``seed`` (deterministic): n ∈ [min_shards, max_shards] shards, sales in [1, 99]."""
    rng = random.Random(derive_seed("wide-task", seed))
    n = rng.randint(min_shards, max_shards)
    product = rng.choice(PRODUCTS)
    shards = tuple(f"s{i:02d}" for i in range(n))
    databases = {s: {p: rng.randint(1, 99) for p in rng.sample(PRODUCTS, 4) + [product]} for s in shards}
    return WideTask(seed, product, shards, databases)


def split_seeds(split: str, count: int, seed: int = 0) -> list[int]:
    """``count`` task seeds of ``split`` ("train": even seeds, "heldout": odd seeds), deterministic in ``seed``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    parity = 0 if split == "train" else 1
    return [2 * (derive_seed(seed, split, i) % 10**8) + parity for i in range(count)]


def parse_facts(text: str) -> dict[str, int]:
    """Every ``sNN=value`` fact in ``text``."""
    return {shard: int(value) for shard, value in FACT.findall(text)}


def verify_answer(task: WideTask, text: str) -> bool:
    """r_perf = 1 iff the last integer of the final answer equals Σ_s sales[s][P] (exact)."""
    numbers = re.findall(r"-?\d+", (text or "").replace(",", ""))
    return bool(numbers) and int(numbers[-1]) == task.answer
