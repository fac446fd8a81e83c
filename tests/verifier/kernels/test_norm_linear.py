"""A projection with the layer's residual add + RMSNorm before it and SwiGLU after it
(verifier.kernels.norm_linear).

On the CPU: the torch reference against the model's eager ops (verifier.model.fusion), and input
validation. On a GPU (`pytest -m gpu`): the CUDA kernel against the reference in every mode, a
row computing bit-identically whatever the other rows are (a token computes the same in a
decode step and in a verify step), and the whole model with and without the kernel.
"""

import pytest
import torch
import torch.nn.functional as F

from verifier import kernels
from verifier.model import ForwardBatch, KVCache, ModelConfig, build_model, fusion
from verifier.step import reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def operands(M, N, K, dtype, device="cpu", silu=False, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * N if silu else N

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    return dict(x=rnd(M, K), weight=rnd(rows, K, scale=K ** -0.5), bias=rnd(N) if bias else None,
                residual=rnd(M, K), norm_weight=1 + rnd(K, scale=0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_eager_ops(dtype):
    o = operands(5, 24, 64, dtype, silu=True)
    y, s = ref.norm_linear(o["x"], o["weight"], None, o["residual"], o["norm_weight"], 1e-5, True)
    s_want, a = fusion.add_rms_norm(o["x"], o["residual"], o["norm_weight"], 1e-5)
    assert torch.equal(s, s_want)
    assert torch.equal(y, fusion.silu_mul(F.linear(a, o["weight"])))
    w = o["weight"][:24]
    y, s = ref.norm_linear(o["x"], w, o["weight"][0, :24], None, o["norm_weight"], 1e-5, False)
    assert s is None
    assert torch.equal(y, F.linear(fusion.rms_norm(o["x"], o["norm_weight"], 1e-5), w, o["weight"][0, :24]))
    y, _ = kernels.norm_linear(o["x"], w)  # CPU tensors: the reference
    assert torch.equal(y, F.linear(o["x"], w))


def test_bad_inputs_raise_value_error():
    o = operands(3, 16, 64, torch.float32)
    x, w, r, nw = o["x"], o["weight"], o["residual"], o["norm_weight"]
    cases = [
        (dict(x=x[:, :32].contiguous(), weight=w), "in_features"),
        (dict(x=x.t().contiguous().t(), weight=w), "contiguous"),
        (dict(x=x.double(), weight=w), "x"),
        (dict(x=x, weight=w[:15], silu=True), "even"),
        (dict(x=x, weight=w, bias=torch.zeros(16), silu=True), "bias"),
        (dict(x=x, weight=w, bias=torch.zeros(15)), "bias"),
        (dict(x=x, weight=w, residual=r), "norm_weight"),
        (dict(x=x, weight=w, residual=r[:2], norm_weight=nw), "residual"),
        (dict(x=x, weight=w, norm_weight=nw[:32]), "norm_weight"),
        (dict(x=x, weight=w, norm_weight=nw, eps=0.0), "eps"),
        (dict(x=x, weight=w, silu=1), "silu"),
        (dict(x=x, weight=w[0]), "weight"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            kernels.norm_linear(**kwargs)


# ------------------------------------------------------------------------------------------ GPU

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}


def call(o, mode, silu, bias, eps=1e-5, fn=kernels.norm_linear):
    residual = o["residual"] if mode == "add_rms" else None
    norm = o["norm_weight"] if mode != "none" else None
    return fn(o["x"], o["weight"], o["bias"] if bias else None, residual, norm, eps, silu)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["none", "rms", "add_rms"])
@pytest.mark.parametrize("silu,bias", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (5, 576, 1536), (8, 64, 4096), (16, 1536, 576), (17, 1536, 576),
                                   (32, 8, 32), (3, 40, 14336)])
def test_native_matches_reference(dtype, mode, silu, bias, M, N, K):
    o = operands(M, N, K, dtype, "cuda", silu, bias, seed=M + N)
    y, s = call(o, mode, silu, bias)
    y_want, s_want = call(o, mode, silu, bias, fn=ref.norm_linear)
    torch.testing.assert_close(y.float(), y_want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    if mode == "add_rms":
        assert torch.equal(s, s_want)  # one rounding of the same float32 sum
    else:
        assert s is None


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode,silu", [("add_rms", True), ("rms", False), ("none", False)])
def test_native_row_does_not_depend_on_the_other_rows(mode, silu):
    """Row r alone, among 17 rows and among 32 rows: the same bits (a decode step's token and the
    same token in a verify step or a batch)."""
    o = operands(32, 1536, 576, torch.bfloat16, "cuda", silu, seed=3)
    full, _ = call(o, mode, silu, False)
    for r in (0, 9, 16, 31):
        one = {k: (v[r:r + 1].contiguous() if k in ("x", "residual") else v) for k, v in o.items()}
        alone, _ = call(one, mode, silu, False)
        assert torch.equal(alone[0], full[r])
        if r < 17:
            some = {k: (v[:17].contiguous() if k in ("x", "residual") else v) for k, v in o.items()}
            assert torch.equal(call(some, mode, silu, False)[0][r], full[r])


@pytest.mark.gpu
@cuda
def test_shapes_beyond_the_native_limits_use_the_reference():
    o = operands(kernels.NORM_LINEAR_MAX_ROWS + 1, 64, 64, torch.bfloat16, "cuda")
    y, _ = kernels.norm_linear(o["x"], o["weight"])
    assert torch.equal(y, F.linear(o["x"], o["weight"]))
    o = operands(4, 64, 256, torch.float16, "cuda")  # a norm in float16: the reference
    assert kernels.checks.norm_linear_native_ok(o["x"], o["weight"], False, True) is not None
    y, s = kernels.norm_linear(o["x"], o["weight"], None, o["residual"], o["norm_weight"], 1e-5)
    y_want, s_want = ref.norm_linear(o["x"], o["weight"], None, o["residual"], o["norm_weight"], 1e-5, False)
    assert torch.equal(y, y_want) and torch.equal(s, s_want)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", [1, 7])
def test_model_with_norm_linear_matches_without(T):
    """bf16 SmolLM2-135M shapes with random weights: a decode/verify step through norm_linear
    against the same step through torch's matmuls and fused elementwise ops."""
    cfg = ModelConfig.from_name("smollm2-135m")
    torch.manual_seed(0)
    model = build_model(cfg, None, "cuda", torch.bfloat16)
    assert model.fused_linear_supported()
    caches = [KVCache(cfg.num_layers, 3, 512, cfg.num_kv_heads, cfg.head_dim, "cuda", torch.bfloat16) for _ in range(2)]
    prompt = torch.randint(0, 1000, (2, 120), device="cuda")
    rows = torch.arange(120, device="cuda").expand(2, 120)
    slots = torch.tensor([2, 0], device="cuda")
    ids = torch.randint(0, 1000, (2, T), device="cuda")
    pos = (120 + torch.arange(T, device="cuda")).expand(2, T).contiguous()
    tree = torch.ones(T, T, dtype=torch.bool, device="cuda").tril().expand(2, T, T).contiguous()
    mask = kernels.tree_attention_mask(tree, torch.full((2,), 120, device="cuda"), 256)
    outs = []
    for fused, cache in zip((True, False), caches):
        model.native_linear = fused
        model(prompt, cache, ForwardBatch(rows, rows, slots, 120, None), last_only=True)
        outs.append(model(ids, cache, ForwardBatch(pos, pos, slots, 256, mask)))
    model.native_linear = True
    a, b = outs
    assert a.shape == b.shape == (2, T, cfg.vocab_size)
    # bf16 over 30 layers: compare the distributions, not the bits
    cos = F.cosine_similarity(a.flatten(0, 1), b.flatten(0, 1), dim=-1)
    assert cos.min() > 0.99, cos


@pytest.mark.gpu
@cuda
def test_start_up_probe_keeps_the_faster_path():
    from verifier.step.cuda_graphs import probe_native_linear

    cfg = ModelConfig.from_name("smollm2-135m", num_layers=2)
    model = build_model(cfg, None, "cuda", torch.bfloat16)
    cache = KVCache(cfg.num_layers, 2, 512, cfg.num_kv_heads, cfg.head_dim, "cuda", torch.bfloat16)
    times = probe_native_linear(model, cache, 1, repeats=5)
    assert set(times) == {"native_ms", "torch_ms"} and min(times.values()) > 0
    assert model.native_linear == (times["native_ms"] <= times["torch_ms"])
