"""The decoder end to end: shapes, padding, latent-cache decode, cache size."""

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer import LatentCache
from tests.conftest import nano_variant


def test_logits_shape(nano):
    ids = torch.randint(0, 128, (3, 11))
    assert nano(ids).logits.shape == (3, 11, 128)


def test_logits_mask_computes_the_head_at_the_selected_positions_only(nano):
    ids = torch.randint(0, 128, (2, 7))
    wanted = torch.zeros(2, 7, dtype=torch.bool)
    wanted[0, 2:4], wanted[1, 5] = True, True
    selected = nano(ids, logits_mask=wanted).logits
    assert selected.shape == (3, 128)
    torch.testing.assert_close(selected, nano(ids).logits[wanted], rtol=1e-5, atol=1e-5)


def test_meta_device_build_allocates_nothing():
    model = build_model(load_preset("k2"), device="meta")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"rope_scaling": None}])
def test_left_padded_batch_matches_unpadded_sequences(overrides):
    model = nano_variant(**overrides)
    a, b = torch.randint(3, 128, (1, 5)), torch.randint(3, 128, (1, 9))
    ids = torch.zeros(2, 9, dtype=torch.long)
    mask = torch.zeros(2, 9, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = a[0], 1
    ids[1], mask[1] = b[0], 1
    batched = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(batched[0, 4:], model(a).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched[1], model(b).logits[0], rtol=1e-5, atol=1e-5)


def test_right_padding_leaves_valid_positions_unchanged(nano):
    a = torch.randint(3, 128, (1, 6))
    ids = torch.cat([a, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 6), torch.zeros(1, 4)], 1).long()
    torch.testing.assert_close(
        nano(ids, attention_mask=mask).logits[:, :6], nano(a).logits, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}, {"n_group": 4, "topk_group": 2}])
@pytest.mark.parametrize("prefill", [1, 4, 12])
def test_cached_decode_reproduces_full_forward(overrides, prefill):
    model = nano_variant(**overrides)
    ids = torch.randint(0, 128, (2, 20))
    full = model(ids).logits
    cache = LatentCache(model.config, batch_size=2, max_length=20)
    steps = [model(ids[:, :prefill], cache=cache).logits]
    steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(prefill, 20)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


def test_decode_uses_absorbed_attention_only_on_latents(nano, monkeypatch):
    """One-token steps never expand cached latents through kv_up (W_UK/W_UV are absorbed)."""
    cache = LatentCache(nano.config, batch_size=1, max_length=16)
    nano(torch.randint(0, 128, (1, 10)), cache=cache)
    expanded_rows = []
    for layer in nano.layers:
        layer.attn.kv_up.register_forward_hook(lambda m, inp, out: expanded_rows.append(inp[0].shape))
    nano(torch.randint(0, 128, (1, 1)), cache=cache)
    assert expanded_rows == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_per_token(dtype):
    config = load_preset("k2-mini")
    cache = LatentCache(config, batch_size=3, max_length=50, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    expected = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * size
    assert cache.bytes_per_token == expected
    assert cache.nbytes() == expected * 3 * 50


def test_k2_cache_bytes_per_token():
    config = load_preset("k2")
    assert (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * 2 == 70_272


def test_backward_reaches_every_parameter(nano):
    nano.train()
    ids = torch.randint(0, 128, (4, 16))
    logits = nano(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    missing = [n for n, p in nano.named_parameters() if p.grad is None]
    # a routed expert that no token picked has no gradient; everything else must
    assert all(".experts." in n for n in missing)


def test_inputs_forward_cannot_take_are_named():
    """Wrong shapes and dtypes failed 13 frames deep (MLA's unpacking, rope's broadcast, a reshape)."""
    model = build_model(load_preset("k2-nano", vocab_size=64))
    ids = torch.zeros(2, 5, dtype=torch.long)
    cases = [
        (dict(input_ids=ids[0]), r"input_ids must be \[B, T\] token ids, got shape \(5,\)"),
        (dict(input_ids=ids[None]), r"input_ids must be \[B, T\] token ids, got shape \(1, 2, 5\)"),
        (
            dict(input_ids=ids.float()),
            r"input_ids must be integer token ids \(torch.long\), got torch.float32",
        ),
        (dict(input_ids=ids[:, :0]), r"no tokens \(T = 0\)"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 4)), r"attention_mask must be \[B, T\] = \[2, 5\]"),
        (dict(input_ids=ids, labels=ids[:, :3]), r"labels must be \[B, T\] = \[2, 5\]"),
        (dict(inputs_embeds=torch.zeros(2, 5)), r"inputs_embeds must be \[B, T, D\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(**kwargs)
    with pytest.raises(TypeError, match=r"build_model\(load_preset\('k2-mini'\)\)"):
        build_model("k2-mini")  # type: ignore[arg-type]
