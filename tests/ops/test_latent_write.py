"""The latent write: the indexed form equals the slice assignment, and a compiled graph performs it in place."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from k2lab.ops.latent_write import write_rows, write_rows_indexed

LAYERS, BATCH, SLOTS, C, R = 3, 2, 37, 24, 8


@pytest.mark.parametrize(("slot", "start", "length"), [(0, 0, 1), (2, 5, 1), (1, 30, 7)])
def test_indexed_write_equals_the_slice_assignment(slot: int, start: int, length: int) -> None:
    rows = torch.randn(LAYERS, BATCH, SLOTS, C + R)
    expected = rows.clone()
    latent, k_rope = torch.randn(BATCH, length, C), torch.randn(BATCH, length, R)
    write_rows(expected, slot, start, latent, k_rope)
    write_rows_indexed(rows, slot, start, latent, k_rope)
    assert torch.equal(rows, expected)


def layers_writing(rows: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """A decode step's pattern: each layer computes its rows, writes them to its slot, then reads the slot."""
    out = x.new_zeros(())
    for slot in range(LAYERS):
        x = torch.tanh(x @ weight)
        write_rows_indexed(rows, slot, start, x[..., :C], x[..., C:])
        out = out + rows[slot, :, : start + x.shape[1]].sum()
    return out


def test_compiled_write_is_in_place() -> None:
    """Compiled with dynamic shapes (Python wrapper, so its buffers show), three layers' writes leave the cache
    as eager's and allocate no 4-d buffer (a storage's copy). The slice assignment, compiled the same way,
    allocates and rewrites the whole storage at every layer (checked by hand: a copy per layer)."""
    torch.manual_seed(0)
    weight = torch.randn(C + R, C + R) / (C + R) ** 0.5
    torch._dynamo.reset()
    compiled = torch.compile(layers_writing, dynamic=True, options={"cpp_wrapper": False})
    rows, expected = torch.zeros(LAYERS, BATCH, SLOTS, C + R), torch.zeros(LAYERS, BATCH, SLOTS, C + R)
    with torch.no_grad():
        for start, length in ((0, 3), (3, 2), (5, 2)):  # one graph (sizes of 1 would be a second)
            x = torch.randn(BATCH, length, C + R)
            out, codes = run_and_get_code(compiled, rows, x, weight, start)
            torch.testing.assert_close(out, layers_writing(expected, x, weight, start))
            torch.testing.assert_close(rows, expected)
            buffers = re.findall(r"empty_strided_cpu\(\((.*?)\),", "\n".join(codes))
            assert not [b for b in buffers if b.count(",") == 3], buffers  # the only 4-d tensor is the cache
