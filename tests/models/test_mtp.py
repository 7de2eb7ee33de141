"""DeepSeek-V3 multi-token prediction: shapes, what each depth reads, the causal chain, hybrid presets."""

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.models.mtp import MultiTokenPrediction
from tests.conftest import KIMI_LINEAR_STYLE, nano_variant, randomize


def test_no_mtp_by_default(nano):
    assert len(nano.mtp) == 0
    assert nano(torch.randint(0, 128, (1, 4))).hidden is None


def test_hidden_is_the_lm_heads_input_at_every_position_under_logits_mask(nano):
    ids = torch.randint(0, 128, (2, 7))
    out = nano(ids, output_hidden=True)
    assert out.hidden.shape == (2, 7, nano.config.hidden_size)
    torch.testing.assert_close(nano.lm_head(out.hidden), out.logits)
    wanted = torch.zeros(2, 7, dtype=torch.bool)
    wanted[0, 1], wanted[1, 3:6] = True, True
    masked = nano(ids, logits_mask=wanted, output_hidden=True)
    torch.testing.assert_close(masked.hidden, out.hidden)  # a prefill's draft needs every position
    torch.testing.assert_close(masked.logits, out.logits[wanted])


def test_mtp_modules_shapes_and_main_weights_unchanged():
    with_mtp = build_model(load_preset("k2-nano", num_nextn_predict_layers=2))
    plain = build_model(load_preset("k2-nano"))
    assert [module.depth for module in with_mtp.mtp] == [1, 2]
    assert isinstance(with_mtp.mtp[0], MultiTokenPrediction)
    D = with_mtp.config.hidden_size
    assert with_mtp.mtp[0].eh_proj.weight.shape == (D, 2 * D)
    # the MTP block is layer num_hidden_layers in the checkpoint layout: MLA, MoE by is_moe_layer
    assert with_mtp.mtp[0].block.kind == "mla"
    assert len(with_mtp.moe_layers()) == len(plain.moe_layers()) + 2
    # initialised like the main layers (N(0, 0.02) matrices, unit norms) ...
    assert abs(with_mtp.mtp[0].eh_proj.weight.std().item() - with_mtp.config.initializer_range) < 2e-3
    assert torch.equal(with_mtp.mtp[1].final_norm.weight, torch.ones(D))
    # ... and drawn after the main ones: the main weights are those of the plain model
    main = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")}
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(main[name], tensor, rtol=0, atol=0)
    ids = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(with_mtp(ids).logits, plain(ids).logits, rtol=0, atol=0)
    logits = with_mtp.mtp_logits(ids, with_mtp(ids, output_hidden=True).hidden)
    assert [tuple(x.shape) for x in logits] == [(2, 9, 128)] * 2


def depth1_by_hand(model, ids: torch.Tensor, i: int) -> torch.Tensor:
    """Depth-1 logits at position i from the equations: h' = eh_proj([enorm(Emb t_{j+1}); hnorm(h_j)]) for
    j <= i, one block, final_norm, lm_head."""
    module = model.mtp[0]
    hidden = model(ids[:, : i + 1], output_hidden=True).hidden  # h_0 … h_i
    embeds = model.embed(ids[:, 1 : i + 2])  # Emb(t_1) … Emb(t_{i+1})
    inputs = model.layer_inputs(ids.shape[0], i + 1, ids.device)
    out = module(hidden, embeds, inputs)
    return model.lm_head(module.final_norm(out))[:, i]


def test_depth1_at_i_reads_exactly_h_i_and_the_embedding_of_t_i_plus_1():
    model = nano_variant(num_nextn_predict_layers=2)
    ids = torch.randint(3, 128, (2, 10))
    logits = model.mtp_logits(ids, model(ids, output_hidden=True).hidden)
    for i in (0, 4, 8):
        torch.testing.assert_close(logits[0][:, i], depth1_by_hand(model, ids, i), rtol=1e-5, atol=1e-5)
    # perturbing t_{i+2} (the depth-1 target at i) leaves depth 1 at j <= i unchanged and changes it at i + 1
    i = 4
    changed = ids.clone()
    changed[:, i + 2] = (ids[:, i + 2] + 1) % 128
    again = model.mtp_logits(changed, model(changed, output_hidden=True).hidden)
    torch.testing.assert_close(again[0][:, : i + 1], logits[0][:, : i + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(again[0][:, i + 1], logits[0][:, i + 1])
    # depth 2 at i reads t_{i+2}: it changes at i, and is unchanged before
    torch.testing.assert_close(again[1][:, :i], logits[1][:, :i], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(again[1][:, i], logits[1][:, i])


def test_depth2_chains_on_depth1_block_output():
    model = nano_variant(num_nextn_predict_layers=2)
    ids = torch.randint(3, 128, (1, 8))
    h0 = model(ids, output_hidden=True).hidden
    embeds = model.embed(ids)
    inputs = model.layer_inputs(1, 8, ids.device)
    zero = torch.zeros(1, 1, model.config.hidden_size)
    h1 = model.mtp[0](h0, torch.cat([embeds[:, 1:], zero], 1), inputs)
    h2 = model.mtp[1](h1, torch.cat([embeds[:, 2:], zero, zero], 1), inputs)
    expected = model.lm_head(model.mtp[1].final_norm(h2))
    torch.testing.assert_close(model.mtp_logits(ids, h0)[1], expected, rtol=1e-5, atol=1e-5)


def test_mtp_respects_packed_documents():
    model = nano_variant(num_nextn_predict_layers=1)
    ids = torch.randint(3, 128, (1, 12))
    segments = torch.tensor([[0] * 5 + [1] * 7])
    packed = model.mtp_logits(ids, model(ids, segment_ids=segments, output_hidden=True).hidden, segments)[0]
    second = ids[:, 5:]
    alone = model.mtp_logits(second, model(second, output_hidden=True).hidden)[0]
    torch.testing.assert_close(packed[:, 5:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["k3-nano", "k2-nano"])
def test_mtp_on_hybrid_and_nope_presets(preset):
    overrides = {"num_nextn_predict_layers": 1}
    if preset == "k2-nano":
        overrides["first_k_dense_replace"] = load_preset("k2-nano").num_hidden_layers
    model = randomize(build_model(load_preset(preset, **overrides)))
    ids = torch.randint(3, 100, (2, 6))
    hidden = model(ids, output_hidden=True).hidden
    (logits,) = model.mtp_logits(ids, hidden)
    assert logits.shape == (2, 6, model.config.vocab_size) and torch.isfinite(logits).all()
    assert model.mtp[0].block.kind == "mla" and not hasattr(model.mtp[0].block, "attn_res")


def test_mtp_on_kimi_linear_style_nope():
    model = randomize(build_model(load_preset("k3-nano", num_nextn_predict_layers=1, **KIMI_LINEAR_STYLE)))
    assert model.rotary is None or not model.config.mla_rope
    ids = torch.randint(3, 100, (1, 5))
    assert torch.isfinite(model.mtp_logits(ids, model(ids, output_hidden=True).hidden)[0]).all()


def test_negative_mtp_layers_is_refused():
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load_preset("k2-nano", num_nextn_predict_layers=-1)
