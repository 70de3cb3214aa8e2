"""The GPU tiers on a real GPU, against the naive reference: ``pytest -m metal`` on Apple
silicon, ``pytest -m cuda`` under MLX's CUDA backend (skipped where neither exists)."""

import mlx.core as mx
import numpy as np
import pytest
from test_kernel_tiers import lce_inputs, qkv, rel

from mlxtune import kernels


def gpu_tiers():
    return [t for t in ("metal", "cuda") if t in kernels.IMPLS]


@pytest.mark.metal
@pytest.mark.cuda
@pytest.mark.skipif(
    not gpu_tiers(),
    reason="needs MLX's Metal backend (Apple silicon) or its CUDA backend (mlx-cuda on NVIDIA)",
)
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-4), (mx.bfloat16, 2e-2)])
def test_gpu_tier_matches_reference(dtype, tol):
    tiers = gpu_tiers()
    h, w, t = lce_inputs(n=300, d=64, v=5000, dtype=dtype)
    q, k, v, ct = qkv(b=2, hq=8, hkv=2, t=300, d=64, dtype=dtype)
    seg = mx.array((np.arange(300)[None, :] // 70 + np.arange(2)[:, None]).astype(np.int32))
    for impl in tiers:
        for ls, cap in ((0.0, None), (0.1, 5.0)):

            def f(h, w, impl=impl, ls=ls, cap=cap):
                return kernels.linear_cross_entropy(
                    h, w, t, label_smoothing=ls, softcap=cap, impl=impl
                )[0]

            got, g1 = mx.value_and_grad(f, argnums=(0, 1))(h, w)
            want, g2 = mx.value_and_grad(lambda h, w: f(h, w, "reference"), argnums=(0, 1))(h, w)
            assert rel(got, want) < tol
            for a, b in zip(g1, g2, strict=True):
                assert rel(a.astype(mx.float32), b.astype(mx.float32)) < tol
        for causal, s in ((True, None), (False, None), (True, seg)):

            def fa(q, k, v, impl=impl, causal=causal, s=s):
                out = kernels.attention(
                    q, k, v, scale=0.125, causal=causal, segment_ids=s, impl=impl
                )
                return (out * ct).sum()

            got, g1 = mx.value_and_grad(fa, argnums=(0, 1, 2))(q, k, v)
            want, g2 = mx.value_and_grad(
                lambda q, k, v: fa(q, k, v, "reference"), argnums=(0, 1, 2)
            )(q, k, v)
            assert rel(got, want) < tol
            for a, b in zip(g1, g2, strict=True):
                assert rel(a.astype(mx.float32), b.astype(mx.float32)) < tol
