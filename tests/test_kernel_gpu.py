"""The GPU tiers on a real GPU, against the naive reference: ``pytest -m metal`` on Apple
silicon, ``pytest -m cuda`` under MLX's CUDA backend (skipped where neither exists).
bench/device/README.md says how to run them on an NVIDIA machine."""

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_tiers import lce_inputs, qkv, rel

from mlxtune import kernels

GPU_TIERS = [t for t in ("metal", "cuda") if t in kernels.IMPLS]
on_gpu = pytest.mark.skipif(
    not GPU_TIERS,
    reason="needs MLX's Metal backend (Apple silicon) or its CUDA backend (mlx-cuda on NVIDIA)",
)
DTYPES = pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-4), (mx.bfloat16, 2e-2)])


def assert_matches_reference(f, args, impl, tol):
    """f(*args, impl) and its gradients with respect to every arg, against the reference tier."""
    argnums = tuple(range(len(args)))
    got, g1 = mx.value_and_grad(lambda *a: f(*a, impl), argnums=argnums)(*args)
    want, g2 = mx.value_and_grad(lambda *a: f(*a, "reference"), argnums=argnums)(*args)
    assert rel(got, want) < tol, impl
    for a, b in zip(g1, g2, strict=True):
        assert rel(a.astype(mx.float32), b.astype(mx.float32)) < tol, impl


@pytest.mark.metal
@pytest.mark.cuda
@on_gpu
@DTYPES
@pytest.mark.parametrize("smoothing,cap", [(0.0, None), (0.1, 5.0)])
@pytest.mark.parametrize("n,v", [(300, 5000), (37, 70001)])
def test_gpu_linear_cross_entropy(dtype, tol, smoothing, cap, n, v):
    h, w, t = lce_inputs(n=n, d=64, v=v, dtype=dtype)

    def f(h, w, impl):
        return kernels.linear_cross_entropy(
            h, w, t, label_smoothing=smoothing, softcap=cap, impl=impl
        )[0]

    for impl in GPU_TIERS:
        assert_matches_reference(f, (h, w), impl, tol)


@pytest.mark.metal
@pytest.mark.cuda
@on_gpu
@DTYPES
@pytest.mark.parametrize("mode", ["causal", "full", "segments"])
@pytest.mark.parametrize("t,d", [(300, 64), (77, 128), (129, 40)])
def test_gpu_attention(dtype, tol, mode, t, d):
    q, k, v, ct = qkv(b=2, hq=8, hkv=2, t=t, d=d, dtype=dtype)
    seg = None
    if mode == "segments":
        seg = mx.array((np.arange(t)[None, :] // 70 + np.arange(2)[:, None]).astype(np.int32))

    def fa(q, k, v, impl):
        out = kernels.attention(
            q, k, v, scale=d**-0.5, causal=mode != "full", segment_ids=seg, impl=impl
        )
        return (out * ct).sum()

    for impl in GPU_TIERS:
        assert_matches_reference(fa, (q, k, v), impl, tol)


@pytest.mark.metal
@pytest.mark.cuda
@on_gpu
def test_gpu_tier_is_picked_and_compiles():
    """auto picks the GPU tier here, and both kernels run inside mx.compile."""
    assert kernels.self_check(GPU_TIERS[0]) is None
    assert kernels.resolve("auto") == GPU_TIERS[0]
    h, w, t = lce_inputs(n=64, d=32, v=1000, dtype=mx.float32)
    q, k, v, ct = qkv(b=1, hq=4, hkv=2, t=64, d=32, dtype=mx.float32)

    def loss(h, w, q, k, v, impl):
        ce = kernels.linear_cross_entropy(h, w, t, impl=impl)[0].sum()
        return ce + (kernels.attention(q, k, v, scale=0.2, impl=impl) * ct).sum()

    step = mx.compile(mx.value_and_grad(lambda *a: loss(*a, GPU_TIERS[0]), argnums=(0, 1, 2)))
    got, g1 = step(h, w, q, k, v)
    want, g2 = mx.value_and_grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2))(h, w, q, k, v)
    assert rel(got, want) < 1e-4
    for a, b in zip(g1, g2, strict=True):
        assert rel(a, b) < 1e-4
