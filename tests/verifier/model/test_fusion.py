"""The compiled elementwise ops (verifier.model.fusion): a forward never fails because dynamo
refuses to compile another version of an op (found on the H200: with fullgraph=True the 9th
version of add_rms_norm raised in the middle of a captured prefill)."""

import pytest
import torch

from verifier.model import fusion


def test_an_op_past_its_recompile_limit_runs_eagerly_from_then_on():
    from torch._dynamo.exc import FailOnRecompileLimitHit

    calls = []

    def compiled(x, residual, weight, eps):
        calls.append("compiled")
        if len(calls) > 1:
            raise FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")
        return fusion.add_rms_norm(x, residual, weight, eps)

    op = fusion._Compiled("add_rms_norm", compiled, fusion.add_rms_norm)
    x, r, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8)
    want = fusion.add_rms_norm(x, r, w, 1e-5)
    for _ in range(3):
        got = op(x, r, w, 1e-5)
        torch.testing.assert_close(got, want)
    assert calls == ["compiled", "compiled"] and op.fn is fusion.add_rms_norm  # never tried again


def test_other_errors_are_not_swallowed():
    def compiled(x):
        raise RuntimeError("a real error")

    op = fusion._Compiled("silu_mul", compiled, fusion.silu_mul)
    with pytest.raises(RuntimeError, match="a real error"):
        op(torch.randn(2, 8))
