"""SwiGLU's activation as one native kernel (verifier.kernels.silu_mul): silu(gate) * up of a fused
gate/up projection, in float32 and rounded once. CPU: the reference and the errors; GPU
(`pytest -m gpu`): the kernel against the reference in every dtype, vectorised and scalar paths.
The model's GPU tests cover it in place (tests/verifier/kernels/test_decode_attention.py, test_engine_gpu)."""

import pytest
import torch
import torch.nn.functional as F

from verifier import kernels
from verifier.step import reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_reference_is_silu_times_up_rounded_once():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g) * 4).to(torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    assert torch.equal(ref.silu_mul(x), (F.silu(gate) * up).to(torch.bfloat16))
    assert ref.silu_mul(x).shape == (3, 5, 8) and ref.silu_mul(x).dtype == torch.bfloat16
    assert torch.equal(kernels.silu_mul(x), ref.silu_mul(x))  # CPU: the reference


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="gate_up: expected dtype"):
        kernels.silu_mul(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 I"):
        kernels.silu_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_mul(torch.zeros(8, 2).t())
    with pytest.raises(ValueError, match="torch.Tensor"):
        kernels.silu_mul([1.0, 2.0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3072), (64, 16, 3072), (5, 22), (7, 2 * 1001), (0, 16)])
def test_native_matches_reference(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to("cuda", dtype)
    if x.numel():
        x.view(-1)[:4] = torch.tensor([0.0, -80.0, 80.0, -0.5])  # silu's saturation and zero
    got, want = kernels.silu_mul(x), ref.silu_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    # exp may differ from torch's by an ulp of float32: at most one rounding step of the dtype
    tol = dict(rtol=2 ** -20, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    if dtype != torch.float32 and x.numel():
        assert (got != want).float().mean() < 0.01  # nearly always the same rounding


@pytest.mark.gpu
@cuda
def test_misaligned_input_takes_the_scalar_path():
    base = torch.randn(4 * 64 + 1, device="cuda").to(torch.bfloat16)
    x = base[1:].view(4, 64)  # 2 bytes past a 16-byte boundary
    torch.testing.assert_close(kernels.silu_mul(x), ref.silu_mul(x), rtol=2 ** -7, atol=1e-3)
