"""The KDA layer's speculative window: with a ``StepRecorder`` view it reports the state after every token,
equal to the states one-token decode steps reach."""

from __future__ import annotations

import torch

from k2lab import load_preset
from k2lab.infer.cache import KDAState
from k2lab.nn.kda import KimiDeltaAttention, causal_short_conv, conv_history_steps, l2_normalize


class Recorder(KDAState):
    record_steps = True

    def update_steps(self, conv, recurrent):
        self.steps = (conv, recurrent)


def test_window_states_equal_step_by_step_decode():
    torch.manual_seed(0)
    config = load_preset("k3-nano")
    layer = KimiDeltaAttention(config).eval()
    layer.forget_gate.reset_decay()  # A_log, dt_bias are torch.empty until initialised (NaN on a dirty heap)
    B, T, H, K = 2, 4, config.linear_num_heads, config.linear_head_dim
    C, W = 3 * H * K, config.linear_conv_kernel_dim
    x = torch.randn(B, 3 + T, config.hidden_size)

    def fresh():
        return KDAState(torch.zeros(B, C, W - 1), torch.zeros(B, H, K, K))

    stepwise = fresh()
    layer(x[:, :3], state=stepwise)
    window = Recorder(stepwise.conv.clone(), stepwise.recurrent.clone())
    outputs, convs, states = [], [], []
    for t in range(3, 3 + T):
        outputs.append(layer(x[:, t : t + 1], state=stepwise))
        convs.append(stepwise.conv.clone())
        states.append(stepwise.recurrent.clone())
    together = layer(x[:, 3:], state=window)
    conv_steps, recurrent_steps = window.steps
    assert torch.allclose(together, torch.cat(outputs, 1), atol=1e-5)
    assert torch.allclose(conv_steps, torch.stack(convs, 1), atol=1e-6)
    assert torch.allclose(recurrent_steps, torch.stack(states, 1), atol=1e-5)


def test_pads_in_a_verify_window_or_a_step_keep_the_states():
    """A speculative verify window with pads (``record_steps``) reports, at each real token, the states of
    the window without its pads and, at a pad, the state before it; a one-token step of a pad changes
    nothing (the single-token path of the short convolution)."""
    torch.manual_seed(0)
    config = load_preset("k3-nano")
    layer = KimiDeltaAttention(config).eval()
    layer.forget_gate.reset_decay()
    B, H, K = 2, config.linear_num_heads, config.linear_head_dim
    C, W = 3 * H * K, config.linear_conv_kernel_dim
    start = KDAState(torch.randn(B, C, W - 1), torch.randn(B, H, K, K))
    x = torch.randn(B, 3, config.hidden_size)
    valid = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    padded_x = torch.randn(B, 6, config.hidden_size).masked_scatter(valid[..., None], x)
    alone, padded = (Recorder(start.conv.clone(), start.recurrent.clone()) for _ in range(2))
    reference = layer(x, state=alone)
    torch.testing.assert_close(layer(padded_x, valid, padded)[valid].view_as(reference), reference)
    before = valid.long().cumsum(1) - 1  # the real token each position's state follows (-1: none yet)
    for steps, first, reached in zip(padded.steps, (start.conv, start.recurrent), alone.steps, strict=True):
        expected = torch.cat((first[:, None], reached), 1)[torch.arange(B)[:, None], before + 1]
        torch.testing.assert_close(steps, expected)
    step = KDAState(start.conv.clone(), start.recurrent.clone())
    layer(x[:, :1], torch.zeros(B, 1, dtype=torch.bool), step)
    assert torch.equal(step.conv, start.conv) and torch.equal(step.recurrent, start.recurrent)


def test_conv_history_steps():
    x = torch.arange(2 * 3 * 1.0).view(1, 3, 2)  # [B, T, C]: token t has values (2t, 2t+1)
    state = torch.tensor([[[-3.0, -2.0, -1.0], [-6.0, -5.0, -4.0]]])  # [B, C, W−1]
    steps = conv_history_steps(x, state)
    assert steps.shape == (1, 3, 2, 3)
    assert steps[0, 0].tolist() == [[-2.0, -1.0, 0.0], [-5.0, -4.0, 1.0]]
    assert steps[0, 2].tolist() == [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]


def test_a_one_tap_conv_keeps_an_empty_history():
    x, weight = torch.randn(2, 5, 3), torch.randn(3, 1, 1)
    y, state = causal_short_conv(x, weight)
    assert state.shape == (2, 3, 0)  # was (2, 3, 5): [-(W - 1):] with W = 1 is the whole window
    torch.testing.assert_close(y, x * weight[:, 0, 0])
    assert conv_history_steps(x, state).shape == (2, 5, 3, 0)


def test_document_conv_equals_each_document_alone():
    """The packed-window short convolution against the plain one run on every document alone (zero history),
    in fp32 and bf16, values and gradients, with documents shorter than the kernel and a window of T < W."""
    generator = torch.Generator().manual_seed(0)
    C, W = 6, 4
    weight = torch.randn(C, 1, W, generator=generator)
    for lengths in ([5, 1, 2, 9], [2]):
        T = sum(lengths)
        starts = torch.zeros(1, T, dtype=torch.bool)
        starts[0, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, T, C, generator=generator).to(dtype).requires_grad_()
            w = weight.clone().requires_grad_()
            packed, _ = causal_short_conv(x, w, document_starts=starts)
            alone = torch.cat([causal_short_conv(d, w)[0] for d in x.split(lengths, 1)], 1)
            tolerance = (
                {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
            )
            assert packed.dtype == dtype
            torch.testing.assert_close(packed, alone, **tolerance)  # conv1d sums the taps in another order
            probe = torch.randn(1, T, C, generator=generator).to(dtype)
            got = torch.autograd.grad((packed.float() * probe).sum(), (x, w))
            want = torch.autograd.grad((alone.float() * probe).sum(), (x, w))
            torch.testing.assert_close(got, want, **tolerance)


def test_l2_normalize_backward():
    """The hand-written backward against torch.autograd.gradcheck (float64) and against autograd through the
    plain formula (fp32, bf16)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, 8, generator=generator, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(l2_normalize, (x,), rtol=1e-6)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        x = (torch.randn(4, 6, 3, 16, generator=generator) * 3).to(dtype).requires_grad_()
        probe = torch.randn(4, 6, 3, 16, generator=generator)
        plain = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        ours = l2_normalize(x)
        torch.testing.assert_close(ours, plain, rtol=0, atol=0)
        (want,) = torch.autograd.grad((plain.float() * probe).sum(), x)
        (got,) = torch.autograd.grad((ours.float() * probe).sum(), x)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
