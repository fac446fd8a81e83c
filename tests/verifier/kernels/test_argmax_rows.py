"""Greedy verification's row reductions in one kernel (verifier.kernels.argmax_rows): the argmax of
each logits row, and rows with a NaN or an infinity zeroed and flagged (as numerics.nonfinite_rows
followed by torch.argmax). CPU: the reference against those two; GPU (`pytest -m gpu`): the
kernel against the reference, ties, odd widths, and 16-bit rows (what their float32 copy gives)."""

import pytest
import torch

from verifier import kernels
from verifier.step import reference as ref
from verifier.step.numerics import nonfinite_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def logits_with_trouble(rows, V, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g).to(device)
    if rows > 3:
        x[1, V // 3] = float("nan")
        x[2, -1] = float("inf")
        x[3, 5 % V] = -float("inf")
    if rows > 4:  # a tie: the first index wins
        x[4] = 0.0
        x[4, V // 2] = x[4, V - 1] = 7.0
    return x


def test_reference_is_nonfinite_rows_then_argmax():
    x = logits_with_trouble(6, 1000)
    want = x.clone()
    bad_want = nonfinite_rows(want)
    idx, bad = ref.argmax_rows(x)
    assert torch.equal(bad, bad_want) and torch.equal(x, want)
    assert torch.equal(idx, want.argmax(-1))
    assert bad.tolist() == [False, True, True, True, False, False]
    assert idx[4] == 500 and idx[1] == 0


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="logits: expected dtype"):
        kernels.argmax_rows(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.argmax_rows(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="logits"):
        kernels.argmax_rows(torch.zeros(3, 0))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(1, 49152), (6, 49152), (2, 8, 1001), (5, 3), (7, 128256)])
def test_native_matches_reference(shape):
    x = logits_with_trouble(shape[0] if len(shape) == 2 else shape[0] * shape[1], shape[-1], "cuda", seed=sum(shape))
    x = x.view(*shape)
    y = x.clone()
    idx, bad = kernels.argmax_rows(x)
    idx_want, bad_want = ref.argmax_rows(y)
    assert torch.equal(bad, bad_want)
    assert torch.equal(idx, idx_want)
    assert torch.equal(x, y)  # bad rows zeroed the same way


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(6, 49152), (2, 8, 1001), (5, 3), (3, 7)])
def test_native_16_bit_rows_match_their_float32_copy(dtype, shape):
    rows = shape[0] if len(shape) == 2 else shape[0] * shape[1]
    x = logits_with_trouble(rows, shape[-1], "cuda", seed=sum(shape)).to(dtype).view(*shape)
    if rows > 5:  # ties created by the rounding itself: many equal 16-bit values
        x.view(rows, shape[-1])[5] = torch.linspace(-1, 1, shape[-1], device="cuda").to(dtype).clamp(max=0.5)
    y = x.float()
    idx, bad = kernels.argmax_rows(x)
    idx_want, bad_want = ref.argmax_rows(y)
    assert torch.equal(bad, bad_want)
    assert torch.equal(idx, idx_want)
    assert torch.equal(x.float(), y)  # bad rows zeroed, the rest untouched


@pytest.mark.gpu
@cuda
def test_misaligned_16_bit_rows_take_the_scalar_path():
    base = logits_with_trouble(4, 1001 * 4 + 1, "cuda", seed=9).to(torch.bfloat16).view(-1)
    x = base[1:1 + 4 * 1000].view(4, 1000)  # rows start 2 bytes past a 16-byte boundary
    idx, bad = kernels.argmax_rows(x)
    idx_want, bad_want = ref.argmax_rows(x.float())
    assert torch.equal(idx, idx_want) and torch.equal(bad, bad_want)
