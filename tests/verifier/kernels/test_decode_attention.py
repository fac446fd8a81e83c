"""RoPE + KV store and decode/verify attention straight from the cache (verifier.kernels).

On the CPU: the torch references against the model's plain-torch path (fusion.rope_qkv +
KVCache.write_kv; SDPA over gathered keys with the additive mask), and input validation. On a GPU
(`pytest -m gpu`): the CUDA kernels against the references, a token computing the same in a
plain step as in a verify step, a NaN in a masked cache row staying out of the output, and the
whole model with the native kernels against plain torch.
"""

import pytest
import torch
import torch.nn.functional as F

from verifier import kernels
from verifier.model import ForwardBatch, KVCache, ModelConfig, build_model, fusion
from verifier.step import reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_cache(layers=2, slots=4, max_len=320, Hkv=3, D=64, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(layers, slots, max_len, Hkv, D, device, dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=g).to(dtype))
    return cache


def random_mask(bs, T, L, seed, dead_rows=True):
    """Prefix columns visible up to a random length, a random tree-ish tail, some empty rows."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, max(1, L - T), (bs,), generator=g)
    cols = torch.arange(L)
    mask = (cols[None, None, :] < prefix[:, None, None]).expand(bs, T, L).clone()
    for b in range(bs):
        for t in range(T):
            p = int(prefix[b])
            mask[b, t, p + t] = p + t < L  # itself
            anc = torch.rand(t, generator=g) < 0.5
            mask[b, t, p:p + t] |= anc[:max(0, min(t, L - p))]
    if dead_rows and bs * T > 2:
        mask[0, T - 1] = False  # a row that sees nothing: zeros
    return mask


def sdpa_path(q, cache, layer, slots, mask):
    """The model's torch path: gathered keys/values, grouped-query rows, additive mask."""
    bs, T, H, D = q.shape
    Hkv = cache.data.shape[2]
    G = H // Hkv
    keys, values = cache.read(layer, slots, mask.shape[2], None)
    bias = torch.zeros(bs, 1, 1, T, mask.shape[2], dtype=q.dtype)
    bias.masked_fill_(~mask[:, None, None], float("-inf"))
    bias = bias.expand(bs, 1, G, T, mask.shape[2]).reshape(bs, 1, G * T, -1)
    qg = q.view(bs, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(bs, Hkv, G * T, D)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=bias)
    return out.view(bs, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(bs, T, H, D)


@pytest.mark.parametrize("H,Hkv,T", [(9, 3, 1), (9, 3, 5), (4, 4, 3), (8, 2, 16)])
def test_reference_attention_matches_sdpa_path(H, Hkv, T):
    cache = make_cache(Hkv=Hkv)
    bs, L = 3, 200
    q = torch.randn(bs, T, H, 64, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([2, 0, 3])
    mask = random_mask(bs, T, L, seed=T, dead_rows=False)  # SDPA gives NaN for a row that sees nothing
    got = ref.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, 64 ** -0.5)
    torch.testing.assert_close(got, sdpa_path(q, cache, 1, slots, mask), rtol=1e-5, atol=1e-5)


def test_reference_attention_row_that_sees_nothing_is_zero():
    cache = make_cache()
    q = torch.randn(1, 2, 3, 64)
    mask = torch.zeros(1, 2, 10, dtype=torch.bool)
    mask[0, 0, :4] = True
    out = kernels.decode_attention(q, cache.data, 0, torch.tensor([1]), cache.max_len, mask)
    assert torch.all(out[0, 1] == 0) and torch.all(out[0, 0] != 0)


def visible_end(mask):
    """[bs] int64: one past each request's last row any of its tokens sees (0: none)."""
    cols = torch.arange(1, mask.shape[2] + 1, device=mask.device)
    return (mask.any(1) * cols).amax(-1).to(torch.int64)


def test_reference_attention_kv_lens_masks_rows_past_it():
    """Rows at or past kv_lens[b] are masked whatever the mask says; kv_lens past the mask's end,
    or exactly at its last visible row, changes nothing; 0 hides everything (zeros)."""
    cache = make_cache()
    bs, T, L = 4, 5, 200
    q = torch.randn(bs, T, 9, 64, generator=torch.Generator().manual_seed(3))
    slots = torch.tensor([2, 0, 3, 1])
    mask = random_mask(bs, T, L, seed=11)
    plain = ref.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, 0.125)
    for lens in (visible_end(mask), torch.full((bs,), 10 ** 6)):
        assert torch.equal(kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, kv_lens=lens), plain)
    lens = torch.tensor([0, 7, 64, 150])
    cut = mask & (torch.arange(L) < lens[:, None])[:, None]
    got = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, kv_lens=lens)
    assert torch.equal(got, ref.decode_attention(q, cache.data, 1, slots, cache.max_len, cut, 0.125))
    assert torch.all(got[0] == 0)


def test_reference_rope_store_matches_torch_path():
    cfg = ModelConfig.from_name("smollm2-135m")
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bs, T = 2, 5
    from verifier.model.rope import rope_cache

    cos, sin = rope_cache(cfg, 320, torch.device("cpu"), torch.float32)
    qkv = torch.randn(bs, T, (H + 2 * Hkv) * D)
    positions = torch.tensor([[3, 4, 5, 6, 7], [100, 101, 101, 102, 103]])
    a, b = make_cache(Hkv=Hkv, D=D), make_cache(Hkv=Hkv, D=D)
    rows = a.flat_rows(torch.tensor([1, 3]), positions).view(-1)
    q_ref = kernels.rope_store_kv(qkv, positions, cos, sin, a.data, 1, rows, H, Hkv)
    q_torch, kv = fusion.rope_qkv(qkv.view(bs, T, H + 2 * Hkv, D), cos[positions][:, :, None], sin[positions][:, :, None],
                                  H, Hkv)
    b.write_kv(1, rows, kv)
    torch.testing.assert_close(q_ref.view(bs, T, H, D), q_torch, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.data, b.data, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_value_error():
    cache = make_cache()
    q = torch.randn(1, 2, 3, 64)
    mask = torch.ones(1, 2, 10, dtype=torch.bool)
    slots = torch.tensor([0])
    with pytest.raises(ValueError, match="layer"):
        kernels.decode_attention(q, cache.data, 2, slots, cache.max_len, mask)
    with pytest.raises(ValueError, match="mask"):
        kernels.decode_attention(q, cache.data, 0, slots, cache.max_len, torch.ones(1, 3, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_len"):
        kernels.decode_attention(q, cache.data, 0, slots, cache.max_len, torch.ones(1, 2, 400, dtype=torch.bool))
    with pytest.raises(ValueError, match="q"):
        kernels.decode_attention(torch.randn(1, 2, 4, 64), cache.data, 0, slots, cache.max_len, mask)
    with pytest.raises(ValueError, match="slots"):
        kernels.decode_attention(q, cache.data, 0, slots.int(), cache.max_len, mask)
    with pytest.raises(ValueError, match="arrivals"):
        kernels.decode_attention(q, cache.data, 0, slots, cache.max_len, mask, arrivals=torch.zeros(4))
    for bad in (torch.tensor([3], dtype=torch.int32), torch.tensor([3, 4]), torch.tensor(3)):
        with pytest.raises(ValueError, match="kv_lens"):
            kernels.decode_attention(q, cache.data, 0, slots, cache.max_len, mask, kv_lens=bad)
    with pytest.raises(ValueError, match="qkv"):
        kernels.rope_store_kv(torch.randn(2, 10), torch.tensor([0, 1]), torch.zeros(8, 64), torch.zeros(8, 64),
                              cache.data, 0, torch.tensor([0, 1]), 3, 3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.rope_store_kv(torch.randn(2, 15 * 64), torch.tensor([0, 1]), torch.zeros(8, 64), torch.zeros(8, 64),
                              cache.data, 0, torch.tensor([0, 1]), 9, 4)


# ------------------------------------------------------------------------------------------ GPU

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (12, 2, 128)])
@pytest.mark.parametrize("bs,T,L", [(1, 1, 256), (3, 5, 300), (2, 16, 64), (1, 64, 1024), (5, 2, 7)])
def test_native_attention_matches_reference(dtype, H, Hkv, D, bs, T, L):
    cache = make_cache(slots=6, max_len=1024, Hkv=Hkv, D=D, dtype=dtype, device="cuda", seed=bs * 7 + T)
    q = torch.randn(bs, T, H, D, generator=torch.Generator().manual_seed(L)).to("cuda", dtype)
    slots = torch.tensor([5, 1, 3, 0, 2][:bs], device="cuda")
    mask = random_mask(bs, T, L, seed=H + L).cuda()
    got = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask)
    want = ref.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, D ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128), (12, 2, 128), (8, 8, 64)])
@pytest.mark.parametrize("bs,T,L", [(1, 1, 512), (3, 1, 2100), (3, 5, 300), (1, 64, 1024), (5, 2, 7), (4, 8, 90)])
def test_native_attention_merged_in_one_kernel_is_identical(dtype, H, Hkv, D, bs, T, L):
    """With arrival counters the split kernel merges its own partials (decode steps: at most 8
    query rows per kv head; larger ones keep the merge kernel): bit for bit what the separate
    merge kernel gives, over repeated calls, and the counters are left zeroed."""
    # kv_len 2100: more than 32 spans (of 64 or 32 rows), so merges take two chunks of splits.
    cache = make_cache(slots=6, max_len=2112, Hkv=Hkv, D=D, dtype=dtype, device="cuda", seed=bs + T)
    q = torch.randn(bs, T, H, D, generator=torch.Generator().manual_seed(L)).to("cuda", dtype)
    slots = torch.tensor([5, 1, 3, 0, 2][:bs], device="cuda")
    mask = random_mask(bs, T, L, seed=H + L).cuda()
    two_kernels = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask)
    for _ in range(3):
        one_kernel = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, arrivals=cache.arrivals)
        assert torch.equal(one_kernel, two_kernels)
    assert not cache.arrivals.any()
    # Too few counters for the grid: the two-kernel path, same result, counters untouched.
    few = torch.zeros(1, dtype=torch.int32, device="cuda")
    if bs * Hkv > 1:
        assert torch.equal(kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, arrivals=few),
                           two_kernels)
        assert not few.any()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128)])
def test_native_rope_store_matches_reference(dtype, H, Hkv, D):
    from verifier.model.rope import rope_cache

    cfg = ModelConfig(vocab_size=10, hidden_size=H * D, intermediate_size=8, num_layers=2, num_heads=H,
                      num_kv_heads=Hkv, head_dim=D)
    cos, sin = rope_cache(cfg, 512, torch.device("cuda"), dtype)
    n = 37
    qkv = torch.randn(n, (H + 2 * Hkv) * D, device="cuda").to(dtype)
    positions = torch.randint(0, 512, (n,), device="cuda")
    rows = torch.randperm(4 * 512, device="cuda")[:n]
    a = make_cache(slots=4, max_len=512, Hkv=Hkv, D=D, dtype=dtype, device="cuda")
    b = make_cache(slots=4, max_len=512, Hkv=Hkv, D=D, dtype=dtype, device="cuda")
    got = kernels.rope_store_kv(qkv, positions, cos, sin, a.data, 1, rows, H, Hkv)
    want = ref.rope_store_kv(qkv, positions, cos, sin, b.data, 1, rows, H, Hkv)
    tol = 0 if dtype == torch.float32 else TOL[dtype]  # one rounding of the same float32 value
    torch.testing.assert_close(got, want, rtol=tol or 1e-6, atol=tol or 1e-6)
    torch.testing.assert_close(a.data, b.data, rtol=tol or 1e-6, atol=tol or 1e-6)


@pytest.mark.gpu
@cuda
def test_native_attention_row_is_the_same_in_plain_and_verify_steps():
    """Node 0 of a 16-node verify step computes exactly what a 1-token decode step computes."""
    cache = make_cache(slots=3, max_len=1024, Hkv=3, D=64, dtype=torch.bfloat16, device="cuda")
    prefix, T, L = 300, 16, 512
    q = torch.randn(1, T, 9, 64, device="cuda").to(torch.bfloat16)
    mask = torch.zeros(1, T, L, dtype=torch.bool, device="cuda")
    mask[0, :, :prefix + 1] = True
    for t in range(1, T):
        mask[0, t, prefix + 1:prefix + 1 + t] = True
    slots = torch.tensor([2], device="cuda")
    verify = kernels.decode_attention(q, cache.data, 0, slots, cache.max_len, mask)
    plain = kernels.decode_attention(q[:, :1].contiguous(), cache.data, 0, slots, cache.max_len, mask[:, :1].contiguous())
    assert torch.equal(verify[:, 0], plain[:, 0])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_native_attention_kv_lens_skips_rows_exactly(dtype, H, Hkv, D, T):
    """A batch whose KV bucket (1100 rows) its longest request sets: with kv_lens at each request's
    own end the kernels read no further (NaN left past it stays out), bit for bit the output
    without kv_lens, merged in one kernel or two; a kv_lens inside what the mask shows cuts it
    as the reference does."""
    bs, L = 5, 1100
    cache = make_cache(slots=6, max_len=1152, Hkv=Hkv, D=D, dtype=dtype, device="cuda", seed=T)
    q = torch.randn(bs, T, H, D, generator=torch.Generator().manual_seed(T)).to("cuda", dtype)
    slots = torch.tensor([5, 1, 3, 0, 2], device="cuda")
    g = torch.Generator().manual_seed(T + 1)
    prefix = torch.tensor([1080, 3, 70, 400, 0])
    mask = torch.arange(L)[None, None, :] < prefix[:, None, None]
    mask = mask.expand(bs, T, L).clone()
    for b in range(bs):
        for t in range(T):
            mask[b, t, prefix[b] + t] = True
            mask[b, t, prefix[b]:prefix[b] + t] |= torch.rand(t, generator=g) < 0.5
    mask = mask.cuda()
    lens = (prefix + T).cuda()
    cut = torch.tensor([1000, 0, 2, 401, 1], device="cuda")
    got = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, kv_lens=cut)
    want = ref.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, D ** -0.5, cut)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    want = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask)
    for b in range(bs):  # stale rows past each request's end: never read with kv_lens
        cache._view[:, int(slots[b]), int(lens[b]):] = float("nan")
    for arrivals in (None, cache.arrivals):
        got = kernels.decode_attention(q, cache.data, 1, slots, cache.max_len, mask, arrivals=arrivals, kv_lens=lens)
        assert torch.equal(got, want)
    assert not cache.arrivals.any()


@pytest.mark.gpu
@cuda
def test_native_attention_ignores_nan_in_masked_rows():
    cache = make_cache(slots=2, max_len=512, Hkv=3, D=64, dtype=torch.bfloat16, device="cuda")
    cache._view[:, 1, 100:] = float("nan")  # stale garbage past the request's rows
    q = torch.randn(1, 1, 9, 64, device="cuda").to(torch.bfloat16)
    mask = torch.zeros(1, 1, 256, dtype=torch.bool, device="cuda")
    mask[0, 0, :100] = True
    out = kernels.decode_attention(q, cache.data, 0, torch.tensor([1], device="cuda"), cache.max_len, mask)
    assert torch.isfinite(out).all()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", [1, 7])
def test_model_with_native_kernels_matches_plain_torch(T):
    cfg = ModelConfig.from_name("smollm2-135m")
    torch.manual_seed(0)
    model = build_model(cfg, None, "cuda", torch.float32)
    caches = [KVCache(cfg.num_layers, 3, 512, cfg.num_kv_heads, cfg.head_dim, "cuda", torch.float32) for _ in range(2)]
    prompt = torch.randint(0, 1000, (2, 120), device="cuda")
    rows = torch.arange(120, device="cuda").expand(2, 120)
    slots = torch.tensor([2, 0], device="cuda")
    ids = torch.randint(0, 1000, (2, T), device="cuda")
    pos = (120 + torch.arange(T, device="cuda")).expand(2, T)
    tree = torch.ones(T, T, dtype=torch.bool, device="cuda").tril().expand(2, T, T).contiguous()
    mask = kernels.tree_attention_mask(tree, torch.full((2,), 120, device="cuda"), 256)
    outs = []
    for native, cache in zip((True, False), caches):
        model.native_kernels = native
        prefill = model(prompt, cache, ForwardBatch(rows, rows, slots, 120, None), last_only=True)
        step = model(ids, cache, ForwardBatch(pos.contiguous(), pos.contiguous(), slots, 256, mask))
        outs.append((prefill, step))
    model.native_kernels = True
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches[0].data, caches[1].data, rtol=1e-5, atol=1e-5)
