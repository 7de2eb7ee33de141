"""`k2lab train` under torchrun (2 processes, FSDP2 on gloo) equals one process with the same global batch,
and checkpoints move between the two: a 2-process checkpoint resumes in one process and vice versa."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from k2lab.errors import K2LabError
from k2lab.train import distributed
from k2lab.train.config import load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.run_checkpoints import list_checkpoints, load_training_checkpoint
from k2lab.train.trainer import run_training

STEPS = 20
TOLERANCE = 1e-3  # relative, per step


@pytest.fixture
def corpus(tiny_corpus):
    return tiny_corpus


@pytest.fixture
def one_thread():
    """The in-process runs use one intra-op thread like the torchrun children (OMP_NUM_THREADS=1): with
    2 cores shared by 2 processes, more threads only spin against each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def recipe(tmp_path, corpus, out, batch_size=4, preset="k2-nano", steps=STEPS):
    # ns_precision = "fp32": with bf16 Newton–Schulz, the float reduction order that differs between one and two
    # processes flips bf16 roundings, which AdamW's sign-like early steps and discrete expert routing
    # amplify into percent-level loss differences after ~10 steps. In fp32 the runs agree to ~1e-7.
    path = tmp_path / f"recipe-{out.name}.toml"
    path.write_text(
        f"""
preset = "{preset}"
vocab_size = 300
data = "{corpus}"
steps = {steps}
batch_size = {batch_size}
seq_len = 32
eval_every = 5
eval_batches = 2
save_every = 10
precision = "fp32"
sample_tokens = 4
out = "{out}"
[optimizer]
lr = 0.01
ns_precision = "fp32"
[schedule]
warmup_steps = 2
"""
    )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(tmp_path, recipe_path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "k2lab",
        "train",
        "--recipe",
        str(recipe_path),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "K2LAB_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def assert_same_curve(got_dir, want_dir, steps=STEPS):
    got, want = read_metrics(got_dir), read_metrics(want_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["step"] for r in want] == list(range(1, steps + 1))
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm", "max_logit", "val_loss"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=TOLERANCE), (g["step"], key)
        assert g["lr"] == w["lr"]
        assert g["expert_load/layer1"] == w["expert_load/layer1"]  # all-reduced: whole-batch counts


def keep_only_first_checkpoint(source, target):
    """A copy of a finished run directory as if it had been killed right after its step-10 checkpoint."""
    shutil.copytree(source, target)
    for step, path in list_checkpoints(target):
        if step != 10:
            shutil.rmtree(path)


@pytest.mark.timeout(240)
def test_two_processes_match_one_and_checkpoints_move_between_them(tmp_path, corpus, capsys, one_thread):
    single, double = tmp_path / "single", tmp_path / "double"
    run_training(load_train_config(recipe(tmp_path, corpus, single)))

    done = torchrun_train(tmp_path, recipe(tmp_path, corpus, double))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("optimizer: muonclip") == 1  # only rank 0 prints
    assert_same_curve(double, single)
    for name in ("dashboard.png", "sample.txt", "summary.json", "model/k2lab.json"):
        assert (double / name).exists(), name

    # the checkpoints on disk hold full tensors, interchangeable with the one-process ones
    _, want = load_training_checkpoint(list_checkpoints(single)[0][1])
    _, got = load_training_checkpoint(list_checkpoints(double)[0][1])
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        assert type(got["model"][name]) is torch.Tensor
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    got_moments, want_moments = (
        got["optimizer"]["optimizer"]["state"],
        want["optimizer"]["optimizer"]["state"],
    )
    assert got_moments.keys() == want_moments.keys()
    for index, entry in want_moments.items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert type(got_moments[index][key]) is torch.Tensor
                torch.testing.assert_close(got_moments[index][key], value, rtol=1e-3, atol=1e-5)
    assert got["data"] == want["data"]

    # a 2-process checkpoint (step 10) resumed in one process continues the same curve
    to_one = tmp_path / "to_one"
    keep_only_first_checkpoint(double, to_one)
    capsys.readouterr()
    run_training(load_train_config(recipe(tmp_path, corpus, to_one)), resume=True)
    assert "resumed" in capsys.readouterr().out
    assert_same_curve(to_one, single)

    # a 1-process checkpoint resumed under 2 processes continues the same curve
    to_two = tmp_path / "to_two"
    keep_only_first_checkpoint(single, to_two)
    done = torchrun_train(tmp_path, recipe(tmp_path, corpus, to_two), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stdout
    assert_same_curve(to_two, single)


@pytest.mark.timeout(240)
def test_block_attnres_layers_are_sharded_like_the_others(tmp_path, corpus, one_thread):
    """k3-nano (Block AttnRes): every layer runs through FSDP2's hooks, so 2 processes equal one. (The layers
    were called past ``__call__``: their weights stayed sharded and the first step failed on mixed
    Tensor/DTensor arguments.)"""
    single, double = tmp_path / "single", tmp_path / "double"
    steps = 5
    run_training(load_train_config(recipe(tmp_path, corpus, single, preset="k3-nano", steps=steps)))
    done = torchrun_train(tmp_path, recipe(tmp_path, corpus, double, preset="k3-nano", steps=steps))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_curve(double, single, steps)
    _, want = load_training_checkpoint(list_checkpoints(single)[-1][1])
    _, got = load_training_checkpoint(list_checkpoints(double)[-1][1])
    for name, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_global_batch_must_split_over_the_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    distributed.check_batch_size(4)
    with pytest.raises(K2LabError, match="batch_size 3 .* 2 data-parallel"):
        distributed.check_batch_size(3)


def test_each_rank_takes_its_slice_of_the_global_batch(monkeypatch):
    batch = torch.arange(12).reshape(6, 2)
    assert distributed.local_rows(batch) is batch  # one process: the whole batch
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    for rank in range(3):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        assert torch.equal(distributed.local_rows(batch), batch[2 * rank : 2 * rank + 2])
    short = torch.arange(4).reshape(2, 2)  # a short last validation batch stays whole on every rank
    assert torch.equal(distributed.local_rows(short), short)


def test_without_a_launcher_everything_is_the_identity():
    assert not distributed.is_distributed() and distributed.is_main() and distributed.world_size() == 1
    assert distributed.all_reduce_mean(1.5) == 1.5
    values = [1.0, 2.0]
    assert distributed.all_reduce_mean(values) is values
    model = torch.nn.Linear(2, 2)
    assert distributed.shard_model(model) is model
    assert distributed.gather_model(model, lambda: None) is model


def test_one_process_device_follows_the_recipe_and_ends_with_the_session(monkeypatch):
    assert distributed.local_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.local_device("auto") == torch.device("cpu")  # no GPU: the CPU
    with pytest.raises(K2LabError, match="sees no CUDA device"):
        distributed.local_device("cuda")
    with pytest.raises(K2LabError), distributed.session("cuda"):
        pass
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert distributed.local_device("auto") == torch.device("cuda", 0)
    assert distributed.local_device("cpu") == torch.device("cpu")  # the recipe can keep it on the CPU
    with distributed.session("auto") as several:
        assert not several and distributed.device() == torch.device("cuda", 0)
    assert distributed.device() == torch.device("cpu")  # outside a session: the CPU again
    with pytest.raises(RuntimeError, match="boom"), distributed.session("auto"):
        raise RuntimeError("boom")
    assert distributed.device() == torch.device("cpu")


@pytest.fixture
def two_ranks(monkeypatch):
    """torchrun's environment for rank 0 of 2; starting the process group records its backend and stops."""
    started = []

    def init_process_group(backend):
        started.append(backend)
        raise RuntimeError("process group started")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    return started


def test_several_processes_follow_the_recipes_device(two_ranks, monkeypatch):
    """`--device cuda` under torchrun on a CPU-only host trained on the CPU; it is refused as in one process."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(K2LabError, match="device = 'cuda' but .* sees no CUDA device"):
        distributed.setup("cuda")
    assert two_ranks == []  # refused before the group starts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for requested, backend in (
        ("cpu", "gloo"),
        ("auto", "cpu:gloo,cuda:nccl"),
        ("cuda", "cpu:gloo,cuda:nccl"),
    ):
        with pytest.raises(RuntimeError, match="process group started"):
            distributed.setup(requested)
        assert two_ranks.pop() == backend


def test_vision_language_runs_are_refused_under_several_processes(two_ranks, tiny_corpus, tmp_path):
    """A vision-language preset under torchrun crashed in shard_model (no decoder ``layers``); it is refused
    before the process group starts or the run directory is made."""
    out = tmp_path / "vl"
    config = load_train_config(None, preset="k25-nano", vocab_size=300, data=str(tiny_corpus), out=str(out))
    with pytest.raises(K2LabError, match="joint vision-text batches are not split .* WORLD_SIZE=2"):
        run_training(config)
    assert two_ranks == [] and not out.exists()
