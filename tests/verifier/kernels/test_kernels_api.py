"""Input checks, CPU dispatch and the nvcc build of verifier.kernels (no GPU needed)."""

import ctypes
import shutil

import pytest
import torch

from verifier import kernels
from verifier.kernels import build, native
from verifier.step import reference as ref

I64 = dict(dtype=torch.int64)


def _tree(bs=2, K=4):
    parents = torch.tensor([[-1, 0, 0, 1]] * bs)
    mask, idx = ref.tree_indices_from_parents(parents, torch.zeros(bs, **I64))
    return parents, mask, idx


def test_cpu_tensors_use_the_reference():
    parents, mask, idx = _tree()
    prefix = torch.tensor([3, 4])
    got_mask, got = kernels.tree_indices_from_parents(parents, prefix)
    want_mask, want = ref.tree_indices_from_parents(parents, prefix)
    assert torch.equal(got_mask, want_mask) and all(torch.equal(a, b) for a, b in zip(got, want))
    cand = torch.tensor([[5, 1, 2, 3]] * 2)
    res = kernels.verify_tree_greedy(cand, *idx[1:], torch.ones(2, 4, **I64), 4)
    assert res.accept_index.dtype == torch.int32 and res.predicts.shape == (8,)


@pytest.mark.parametrize("bad, match", [
    (lambda m, p: (m[:, :, :3].contiguous(), p), r"tree_mask: expected \[bs, K, K\]"),
    (lambda m, p: (m.int(), p), "tree_mask: expected dtype"),
    (lambda m, p: (m, p.int()), "prefix_lens: expected dtype torch.int64"),
    (lambda m, p: (m, p[:1]), r"prefix_lens: expected shape \(2,\)"),
    (lambda m, p: (m.transpose(1, 2), p), "contiguous"),
    (lambda m, p: (torch.ones(1, 65, 65, dtype=torch.bool), torch.zeros(1, **I64)), r"K .* must be in \[1, 64\], got 65"),
])
def test_tree_mask_checks(bad, match):
    _, mask, _ = _tree()
    with pytest.raises(ValueError, match=match):
        kernels.tree_indices_from_mask(*bad(mask, torch.zeros(2, **I64)))


def test_verify_checks():
    _, _, idx = _tree()
    cand = torch.zeros(2, 4, **I64)
    with pytest.raises(ValueError, match="target_predict: expected shape"):
        kernels.verify_tree_greedy(cand, *idx[1:], torch.zeros(2, 3, **I64), 4)
    with pytest.raises(ValueError, match="num_spec_steps"):
        kernels.verify_tree_greedy(cand, *idx[1:], torch.zeros(2, 4, **I64), 0)
    probs = torch.full((2, 4, 5), 0.2)
    coins, final = torch.rand(2, 4), torch.rand(2)
    with pytest.raises(ValueError, match="target_probs: expected dtype torch.float32"):
        kernels.tree_speculative_sampling(cand, *idx[1:], coins, final, probs.double(), 4)
    with pytest.raises(ValueError, match="final_coins: expected shape"):
        kernels.tree_speculative_sampling(cand, *idx[1:], coins, coins, probs, 4)
    with pytest.raises(ValueError, match="threshold_acc must be in"):
        kernels.tree_speculative_sampling(cand, *idx[1:], coins, final, probs, 4, 1.0, 1.5)


def test_sampling_from_logits_checks():
    _, _, idx = _tree()
    cand = torch.zeros(2, 4, **I64)
    logits, temp = torch.zeros(2, 4, 5), torch.ones(8)
    coins, final = torch.rand(2, 4), torch.rand(2)
    with pytest.raises(ValueError, match="logits: expected dtype"):
        kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits.double(), temp, 4)
    with pytest.raises(ValueError, match=r"logits: expected \[bs=2, K=4, vocab\]"):
        kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits[:, :3].contiguous(), temp, 4)
    with pytest.raises(ValueError, match=r"temperature: expected shape \(8,\)"):
        kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits, temp[:2], 4)
    with pytest.raises(ValueError, match="temperature: expected dtype torch.float32"):
        kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits, temp.double(), 4)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits.transpose(0, 1).contiguous().transpose(0, 1),
                                     temp, 4)


def test_sampling_from_logits_is_sampling_from_their_softmax():
    """The reference: softmax(logits / T) per row, one-hot at the argmax where T = 0, and a row with a
    NaN or an infinity verified as zeroed logits and flagged; bfloat16 logits as their float32 copy."""
    parents = torch.tensor([[-1, 0, 0, 1]] * 3)
    _, idx = ref.tree_indices_from_parents(parents, torch.zeros(3, **I64))
    cand = torch.tensor([[9, 1, 2, 3]] * 3)
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 4, 6, generator=g)).bfloat16()
    logits[2, 1, 4] = float("nan")
    temp = torch.tensor([0.7] * 4 + [0.0] * 4 + [1.3] * 4)
    coins, final = torch.rand(3, 4, generator=g), torch.rand(3, generator=g)
    res, bad = kernels.tree_sampling_logits(cand, *idx[1:], coins, final, logits, temp, 4)
    assert bad.tolist() == [[False] * 4, [False] * 4, [False, True, False, False]]
    flat = logits.float().reshape(12, 6)
    flat[9] = 0.0  # the NaN row, zeroed
    probs = (flat / torch.where(temp == 0, 1.0, temp)[:, None]).softmax(-1)
    probs[4:8] = torch.nn.functional.one_hot(flat[4:8].argmax(-1), 6).float()
    want = ref.tree_speculative_sampling(cand, *idx[1:], coins, final, probs.view(3, 4, 6), 4)
    assert all(torch.equal(a, b) for a, b in zip(res, want))


def test_compaction_checks():
    slots = torch.arange(8).reshape(2, 4)
    ai, num = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache: expected \\[num_caches"):
        kernels.compact_kv_cache(torch.zeros(8, 4), slots, ai, num)
    with pytest.raises(ValueError, match="accept_index: expected dtype torch.int32"):
        kernels.compact_kv_cache(torch.zeros(2, 8, 4), slots, ai.long(), num)


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("NGRAM_NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(build.BuildError, match="nvcc not found"):
        build.build(build.BuildConfig.from_env())


@pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed: CUDA sources not compiled")
def test_cuda_sources_compile_for_sm90(tmp_path):
    """Catches build errors in CI; loads the library (no GPU needed) and checks an argument error
    comes back with file:line."""
    lib_path = build.build(build.BuildConfig(archs=("90",), cache_root=tmp_path))
    lib = ctypes.CDLL(str(lib_path))
    lib.ngk_abi_version.restype = ctypes.c_int
    assert lib.ngk_abi_version() == native.ABI_VERSION
    lib.ngk_last_error.restype = ctypes.c_char_p
    rc = lib.ngk_verify_tree_greedy(*([None] * 8), 1, 65, 4, None)  # K = 65 is refused before any launch
    assert rc == -1
    assert b"verify_greedy.cu:" in lib.ngk_last_error() and b"K <= NGK_MAX_NODES" in lib.ngk_last_error()
    # the cache is reused: same sources and flags -> same path, no rebuild
    assert build.build(build.BuildConfig(archs=("90",), cache_root=tmp_path)) == lib_path
