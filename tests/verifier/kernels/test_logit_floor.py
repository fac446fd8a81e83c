"""Top-k / top-p as a floor per logits row (verifier.kernels.logit_floor, csrc/logit_floor.cu; the
torch reference verifier.step.sampling.truncation_floor). CPU: the reference against the
definition (a float64 walk down the sorted row), ties at the cutoff kept, the rows that get no
floor, and the argument errors. GPU (`pytest -m gpu`): the kernel against the same definition on
float32 and bfloat16 rows (bf16 rows are full of ties), deterministic run to run, and equal to the
reference wherever the cumulative mass is not within rounding of top_p."""

import pytest
import torch

from verifier import kernels
from verifier.step.sampling import truncation_floor

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
INF = float("inf")


def definition(x: torch.Tensor, t: float, k: int, p: float) -> tuple[float, float, float]:
    """(floor, the mass strictly above it, the mass at or above it) of one row by the definition,
    in float64, the masses relative to what top-k kept; -inf where nothing truncates."""
    x = x.double()
    V = x.numel()
    if t <= 0 or not bool(torch.isfinite(x).all()) or ((k <= 0 or k >= V) and p >= 1.0):
        return -INF, 0.0, 1.0
    xs = x.sort(descending=True).values
    floor_k = float(xs[k - 1]) if 0 < k < V else -INF
    w = ((x - xs[0]) / t).exp() * (x >= floor_k)
    total = float(w.sum())
    floor = floor_k
    if p < 1.0:
        cum = ((xs - xs[0]) / t).exp() * (xs >= floor_k)
        m = int((cum.cumsum(0) < p * total).sum().clamp(max=V - 1))
        floor = max(floor, float(xs[m]))
    return floor, float(w[x > floor].sum()) / total, float(w[x >= floor].sum()) / total


def rows(n: int, V: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, V, generator=g) * torch.empty(n, 1).uniform_(0.5, 6, generator=g)).to(dtype)
    temp = torch.empty(n).uniform_(0.3, 1.5, generator=g)
    top_k = torch.where(torch.rand(n, generator=g) < 0.4, torch.randint(1, V + 5, (n,), generator=g), 0).float()
    top_p = torch.where(torch.rand(n, generator=g) < 0.7, torch.empty(n).uniform_(0.05, 0.999, generator=g), 1.0)
    return logits, temp, top_k, top_p


def check_row(x, floor, t, k, p, tol=1e-5):
    """The floor is a cutoff the definition allows: top-k's count, and top-p's mass within tol."""
    want, _, _ = definition(x, t, k, p)
    if want == -INF:
        assert floor == -INF
        return
    x = x.double()
    V = x.numel()
    xs = x.sort(descending=True).values
    floor_k = float(xs[k - 1]) if 0 < k < V else -INF
    if p >= 1.0:
        assert floor == floor_k  # top-k alone: the k-th largest, exactly
        return
    w = ((x - xs[0]) / t).exp() * (x >= floor_k)  # top-p's masses over what top-k kept
    total = float(w.sum())
    above, kept = float(w[x > floor].sum()) / total, float(w[x >= floor].sum()) / total
    assert floor >= floor_k and kept >= p - tol and above < p + tol, (floor, want, above, kept, p)


def test_reference_is_the_definition():
    logits, temp, top_k, top_p = rows(64, 300)
    floor = truncation_floor(logits, temp, top_k, top_p)
    for i in range(64):
        want, _, _ = definition(logits[i], float(temp[i]), int(top_k[i]), float(top_p[i]))
        assert float(floor[i]) == pytest.approx(want) or (want == -INF and float(floor[i]) == -INF)
        check_row(logits[i], float(floor[i]), float(temp[i]), int(top_k[i]), float(top_p[i]))


def test_ties_at_the_cutoff_are_all_kept():
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    one = torch.ones(1)
    assert float(truncation_floor(x, one, torch.tensor([2.0]), one)) == 3.0  # top-2 keeps the three 3.0s
    kept = torch.exp(x[0] - 5.0)
    p = float(kept[0] / kept.sum()) + 1e-3  # just past the first token: the tied group all stays
    assert float(truncation_floor(x, one, torch.zeros(1), torch.tensor([p]))) == 3.0


def test_rows_without_a_floor():
    x = torch.randn(5, 40)
    x[3, 7] = float("nan")
    temp = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([5.0, 0.0, 40.0, 5.0, 1.0])
    top_p = torch.tensor([0.5, 1.0, 1.0, 0.5, 1.0])
    floor = truncation_floor(x, temp, top_k, top_p)
    assert floor[:4].tolist() == [-INF] * 4  # greedy, off, k = V, a NaN
    assert float(floor[4]) == float(x[4].max())  # top-1: the argmax alone


def test_bad_arguments_are_value_errors():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="top_p: expected shape"):
        kernels.logit_floor(x, torch.ones(3), None, torch.ones(2))
    with pytest.raises(ValueError, match="top_k: expected dtype"):
        kernels.logit_floor(x, torch.ones(3), torch.ones(3, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="temperature"):
        kernels.logit_floor(x, torch.ones(4), None, None)
    assert torch.equal(kernels.logit_floor(x, torch.ones(3), None, torch.full((3,), 0.5)),
                       truncation_floor(x, torch.ones(3), torch.zeros(3), torch.full((3,), 0.5)))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,V", [(7, 5), (64, 1001), (300, 49152)])
def test_kernel_meets_the_definition(n, V, dtype):
    logits, temp, top_k, top_p = rows(n, V, dtype, seed=n + V)
    logits[0, 1] = float("nan") if n > 1 else logits[0, 1]
    temp[2 % n] = 0.0
    dev = [t.cuda() for t in (logits, temp, top_k, top_p)]
    got = kernels.logit_floor(*dev)
    assert torch.equal(got, kernels.logit_floor(*dev))  # fixed-point masses: the same every run
    got = got.cpu()
    ref = truncation_floor(logits, temp, top_k, top_p)
    x = logits.float()
    for i in range(n):
        check_row(x[i], float(got[i]), float(temp[i]), int(top_k[i]), float(top_p[i]))
    assert int((got != ref).sum()) <= max(1, n // 50)  # rounding of the cumulative mass, rarely


@pytest.mark.gpu
@cuda
def test_kernel_keeps_tied_groups():
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]] * 2, device="cuda")
    got = kernels.logit_floor(x, torch.ones(2, device="cuda"), torch.tensor([2.0, 0.0], device="cuda"),
                              torch.tensor([1.0, 0.75], device="cuda"))
    assert got.tolist() == [3.0, 3.0]
