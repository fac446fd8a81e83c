"""``target_probs`` (verifier/step/sampling.py): without top-k / top-p truncation it is the softmax of
logits / temperature, the same distribution as the sorted path up to float rounding; with truncation
on any row (told, or read from the tensors) every row goes through the sorted path."""

import torch

from verifier.step.sampling import target_probs


def _rows(n: int = 6, V: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 3
    temp = torch.linspace(0.3, 1.5, n)
    return logits, temp, torch.zeros(n, dtype=torch.long), torch.ones(n)


def test_untruncated_rows_are_the_softmax_of_the_sorted_path():
    logits, temp, top_k, top_p = _rows()
    fast = target_probs(logits, temp, top_k, top_p, truncated=False)
    assert torch.equal(fast, (logits / temp[:, None]).softmax(-1))
    assert torch.allclose(fast, target_probs(logits, temp, top_k, top_p, truncated=True), atol=1e-6)
    assert torch.equal(target_probs(logits, temp, top_k, top_p), fast)  # read from the tensors: none truncates
    top_k[:] = 50  # top_k = V keeps every token: no truncation either
    assert torch.equal(target_probs(logits, temp, top_k, top_p), fast)


def test_a_truncating_row_is_read_from_the_tensors():
    logits, temp, top_k, top_p = _rows()
    top_k[2], top_p[4] = 5, 0.5
    probs = target_probs(logits, temp, top_k, top_p)
    assert int((probs[2] > 0).sum()) == 5
    kept = probs[4] > 0
    assert 1 <= int(kept.sum()) < 50 and float(probs[4].sum()) > 0.999
    assert torch.equal(probs, target_probs(logits, temp, top_k, top_p, truncated=True))
    assert torch.allclose(probs[0], (logits[0] / temp[0]).softmax(-1), atol=1e-6)  # the others: untouched
