"""Beyond logits: padded batches, gradients and greedy generation against transformers' DeepseekV3."""

import pytest
import torch

from k2lab.hf.bridge import to_transformers
from k2lab.infer import GenerationConfig, generate
from tests.conftest import nano_variant

pytest.importorskip("transformers")

CONFIGS = {
    "yarn-groups": {},
    "no-q-lora-4-groups": {"q_lora_rank": None, "n_routed_experts": 16, "n_group": 4, "topk_group": 2},
}


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def pair(request):
    ours = nano_variant(**CONFIGS[request.param])
    return ours, to_transformers(ours)


def test_left_padded_logits(pair):
    ours, theirs = pair
    ids = torch.randint(3, 128, (3, 24))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[2, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        a = ours(ids, attention_mask=mask).logits
        b = theirs(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(a * mask[..., None], b * mask[..., None], rtol=1e-4, atol=1e-4)


def test_gradients(pair):
    ours, theirs = pair
    ids = torch.randint(3, 128, (2, 32))  # no pad token: transformers' padding_idx row never gets a gradient
    ours(ids).logits.pow(2).mean().backward()
    theirs(ids).logits.pow(2).mean().backward()
    last = ours.config.num_hidden_layers - 1
    pairs = [
        (ours.embed.weight.grad, theirs.model.embed_tokens.weight.grad),
        (ours.layers[0].attn.kv_up.weight.grad, theirs.model.layers[0].self_attn.kv_b_proj.weight.grad),
        (
            ours.layers[last].mlp.experts.down_proj.grad,
            theirs.model.layers[last].mlp.experts.down_proj.grad,
        ),
    ]
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_greedy_generation_identical(pair):
    ours, theirs = pair
    prompt = torch.randint(3, 128, (2, 12))
    expected = theirs.generate(
        prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=10
    )[:, 12:]
    got = generate(ours, prompt.tolist(), GenerationConfig(max_new_tokens=10))
    assert got == expected.tolist()


def test_checkpoint_with_mtp_layer_loads_in_transformers_with_the_same_main_logits(tmp_path):
    """transformers' DeepseekV3ForCausalLM builds no MTP layer: it reports layer num_hidden_layers as
    unexpected (its ignore pattern is K2/V3's layer 61) and must load everything else, with our logits."""
    import transformers

    from k2lab.hf import to_hf

    ours = nano_variant(num_nextn_predict_layers=1)
    to_hf(ours, tmp_path / "ckpt")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", output_loading_info=True
    )
    mtp_layer = f"model.layers.{ours.config.num_hidden_layers}."
    assert info["unexpected_keys"] and all(key.startswith(mtp_layer) for key in info["unexpected_keys"])
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids = torch.randint(3, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs.eval()(ids).logits, rtol=1e-4, atol=1e-4)
    assert to_transformers(ours).config.num_nextn_predict_layers == 1  # the bridge leaves the MTP layer out
