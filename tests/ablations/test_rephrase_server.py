"""The rephrase ablation's local server: one OpenMP team while it serves, the caller's threads back after."""

import httpx
import torch

from k2lab import build_model, load_preset
from k2lab.ablations.rephrase import local_server
from k2lab.model_dir import save_model


def test_local_server_serves_with_one_team_and_gives_the_threads_back(tmp_path, small_tokenizer) -> None:
    save_model(build_model(load_preset("k2-nano", vocab_size=300)), tmp_path / "model")
    small_tokenizer.save(str(tmp_path / "model" / "tokenizer.json"))
    original = torch.get_num_threads()
    torch.set_num_threads(2)  # a count the caller would notice losing (the suite's workers may run at one)
    try:
        with local_server(tmp_path / "model", max_batch=2) as (base_url, name):
            assert torch.get_num_threads() == 1  # the caller (HTTP client, loading) stays single-threaded
            # ignore_eos: a random model samples its stop token first now and then (~1 % of runs: a reply of 0)
            body = {"model": name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                    "ignore_eos": True}  # fmt: skip
            reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
            assert reply["usage"]["completion_tokens"] == 3
        assert torch.get_num_threads() == 2  # back for the training that follows
    finally:
        torch.set_num_threads(original)
