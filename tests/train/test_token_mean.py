"""Data-parallel SFT trains one process's objective: ranks holding different numbers of target tokens (masked
prompts, a PTX mix, MTP depths) weight their losses by them, so 2 processes equal 1 in loss and weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.data import load_corpus, train_tokenizer
from k2lab.model_dir import load_model, save_model
from k2lab.train.config import load_sft_config
from k2lab.train.metrics import read_metrics
from k2lab.train.token_mean import batch_means, global_token_means, rank_shares, scored_counts
from k2lab.train.trainer import run_training
from tests.conftest import free_port

STEPS = 3


def conversation(i: int) -> dict:
    """A long prompt and a short answer, or the other way round: rows with very different target counts."""
    prompt, answer = ("the quick brown fox " * (1 + 3 * (i % 2)), "jumps " * (1 + 4 * (1 - i % 2)))
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


@pytest.fixture
def sft_setup(tiny_corpus, tmp_path):
    """A random k2-nano checkpoint with one MTP depth, 8 conversations and an SFT recipe with a 50 % PTX mix
    and 2 micro-batches a step (PTX rows come last in a micro-batch: rank 1 holds most of them)."""
    tokenizer = train_tokenizer(load_corpus(tiny_corpus), 300, use_cache=False)
    special = dict(
        pad_token_id=tokenizer.pad_id, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id
    )
    config = load_preset("k2-nano", vocab_size=tokenizer.vocab_size, num_nextn_predict_layers=1, **special)
    save_model(build_model(config, seed=0), tmp_path / "ckpt")
    tokenizer.save(tmp_path / "ckpt" / "tokenizer.json")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(conversation(i)) + "\n" for i in range(8)))
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        f"steps = {STEPS}\nbatch_size = 4\ngrad_accum = 2\nseq_len = 48\neval_every = {STEPS}\neval_batches = 1\n"
        f'save_every = {STEPS}\nprecision = "fp32"\nsample_tokens = 0\ndata = "{tiny_corpus}"\n'
        f'mtp_loss_weight = 0.3\n[optimizer]\nlr = 0.01\nns_precision = "fp32"\n'
        f'[sft]\ninit_checkpoint = "{tmp_path / "ckpt"}"\ndata = "{data}"\nptx_ratio = 0.5\n'
    )
    return recipe


@pytest.mark.timeout(240)
def test_two_process_sft_with_uneven_targets_matches_one(sft_setup, tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(load_sft_config(sft_setup, out=str(single)))
    finally:
        torch.set_num_threads(threads)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
        f"--master_port={free_port()}", "-m", "k2lab", "sft", "--recipe", str(sft_setup), "--out", str(double),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got, want = read_metrics(double), read_metrics(single)
    assert len(got) == len(want) == STEPS
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "mtp_loss", "mtp_top1", "grad_norm", "val_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (g["step"], key)
    trained, reference = load_model(double / "model"), load_model(single / "model")
    for (name, p), q in zip(trained.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)


def test_alone_the_losses_pass_through_unchanged():
    labels = torch.tensor([[-100, 3, 4, -100], [5, -100, -100, 6]])
    assert scored_counts(labels, 2).tolist() == [4, 3, 2]
    loss = torch.tensor(1.5)
    assert global_token_means(loss, None, labels) == (loss, None)
    means = torch.tensor([1.0, 2.0])
    assert rank_shares(means, torch.tensor([3, 0])) is means
    assert batch_means([loss, torch.tensor(2.5)], [labels, labels]) == [1.5, 2.5]


def test_a_rank_without_scored_targets_adds_nothing(monkeypatch):
    """s_r = ℓ_r · W · n_r / N and 0 where n_r = 0: a rank whose rows are all masked has a NaN mean (0/0)
    that must not reach the gradient. Here this rank is one of W = 2 whose partner holds counts [5, 1]."""
    from k2lab.train import token_mean

    def all_reduce(tensor):  # the SUM over both ranks
        tensor += torch.tensor([5, 1])

    monkeypatch.setattr(token_mean.distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(token_mean.distributed, "world_size", lambda: 2)
    monkeypatch.setattr(token_mean.dist, "all_reduce", all_reduce)
    shares = rank_shares(torch.tensor([float("nan"), 2.0]), torch.tensor([0, 3]))
    assert shares.tolist() == [0.0, pytest.approx(2.0 * 2 * 3 / 4)]
