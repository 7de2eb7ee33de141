"""Run under ``torchrun --nproc_per_node 2``: MuonClip on FSDP2-sharded k2-nano vs one process.

Each rank trains on its half of the batch with ``fully_shard`` parameters (gloo on CPU); rank 0 also
runs the same steps unsharded on the whole batch. Prints one JSON line with the largest differences.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from k2lab import build_model, load_preset
from k2lab.optim import MuonClip, OptimizerConfig

STEPS = 3


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = load_preset("k2-nano")
    reference = build_model(config, seed=0)
    with torch.no_grad():  # larger weights so logits pass a low τ and clipping really happens
        for p in reference.parameters():
            p.mul_(6.0)
    sharded = copy.deepcopy(reference)
    for layer in sharded.layers:
        fully_shard(layer)
    fully_shard(sharded)

    initial = [p.detach().clone() for p in reference.parameters()]
    settings = OptimizerConfig(
        name="muonclip", lr=0.02, qk_clip_tau=2.0, ns_precision=os.environ.get("K2LAB_TEST_NS", "fp32")
    )
    sharded_opt = MuonClip(sharded, settings, verbose=False)
    reference_opt = MuonClip(reference, settings, verbose=False)
    data = torch.randint(0, config.vocab_size, (4 * world, 17), generator=torch.Generator().manual_seed(1))
    local = data.chunk(world)[rank]

    stats = []
    for _ in range(STEPS):
        loss_of(sharded, local).backward()
        sharded_stats = sharded_opt.step()
        sharded_opt.zero_grad()
        loss_of(reference, data).backward()
        reference_stats = reference_opt.step()
        reference_opt.zero_grad()
        stats.append((sharded_stats, reference_stats))

    worst, worst_name = 0.0, ""
    named = zip(sharded.named_parameters(), reference.parameters(), initial, strict=True)
    for (name, p), ref, start in named:
        full, ref = p.detach().full_tensor(), ref.detach()
        # difference relative to how far training moved the parameter
        moved = (ref - start).abs().max().clamp(min=1e-12)
        gap = float((full - ref).abs().max() / moved)
        if gap > worst:
            worst, worst_name = gap, name
    result = {
        "rank": rank,
        "max_diff_rel_to_update": worst,
        "worst_parameter": worst_name,
        "clipped_heads": [s["qk_clipped_heads"] for s, _ in stats],
        "reference_clipped_heads": [r["qk_clipped_heads"] for _, r in stats],
        "max_logit": [s["max_logit"] for s, _ in stats],
        "reference_max_logit": [r["max_logit"] for _, r in stats],
        "update_rms": [s["muon_update_rms"] for s, _ in stats],
        "reference_update_rms": [r["muon_update_rms"] for _, r in stats],
    }
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()  # both ranks finish their collectives before the process group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Skip interpreter teardown: gloo worker threads that still hold finished work objects can abort the
    # process during finalisation (pytorch/pytorch#179291), after every result is already printed.
    sys.stdout.flush()
    os._exit(0)
