"""kernels/cpu.py (the CPU backend's exp, softmax, SwiGLU and short-row attention) against naive
MLX references, in values and gradients; where the trainer uses them; and the malloc setup."""

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_attention import naive, qkv, segments

from conftest import peak_memory_mb
from mlxtune.kernels import attention, cpu, flash


def rel(a, b):
    a, b = (np.array(x.astype(mx.float32), np.float64) for x in (a, b))
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("compiled", [False, True])
def test_exp_matches_float64_to_a_millionth(compiled):
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 200_001), mx.array([0.0, -1e-30, -0.5, -1.0])])
    fn = mx.compile(cpu.exp_nonpositive) if compiled else cpu.exp_nonpositive
    got = np.array(fn(x), np.float64)
    want = np.exp(np.array(x, np.float64))
    assert np.max(np.abs(got / want - 1)) < 1e-6
    assert fn(mx.array([0.0])).item() == 1.0


def test_exp_below_the_normal_range_and_nan():
    out = np.array(cpu.exp_nonpositive(mx.array([-87.3, -88.0, -1e30, -mx.inf, mx.nan])))
    assert 0 < out[0] < 1.3e-38 and out[0] == pytest.approx(np.exp(-87.3), rel=1e-5)
    assert np.all(out[1:4] == 0)  # flushed, as a subnormal would be: e^-inf is 0
    assert np.isnan(out[4])
    for dtype in (mx.float16, mx.bfloat16):
        half = cpu.exp_nonpositive(mx.array([-1.0, -mx.inf], dtype=dtype))
        assert half.dtype == dtype and half[1].item() == 0
        assert half[0].item() == pytest.approx(np.exp(-1.0), rel=1e-2)


def test_logsumexp_and_softmax_with_masked_entries():
    x = mx.array([[-mx.inf, -mx.inf, -mx.inf], [1.0, -mx.inf, 2.0], [0.5, -3.0, 40.0]])
    got = np.array(cpu.logsumexp(x))
    want = np.array(mx.logsumexp(x, axis=-1))
    assert got[0] == -np.inf
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6)
    p = np.array(cpu.softmax(x[1:]))
    assert p[0, 1] == 0
    np.testing.assert_allclose(p, np.array(mx.softmax(x[1:], axis=-1)), rtol=1e-5, atol=0)


def test_softmax_values_and_gradients():
    x = 4 * mx.random.normal((6, 5, 77), key=mx.random.key(1))
    x = mx.where(mx.arange(77) % 11 == 3, -1e30, x)  # masked entries
    w = mx.random.normal(x.shape, key=mx.random.key(2))

    def ours(x):
        return (cpu.softmax(x) * w).sum()

    def ref(x):
        return (mx.softmax(x, axis=-1, precise=True) * w).sum()

    np.testing.assert_allclose(
        np.array(cpu.softmax(x)), np.array(mx.softmax(x, axis=-1)), rtol=1e-5, atol=1e-7
    )
    np.testing.assert_allclose(
        np.array(mx.grad(ours)(x)), np.array(mx.grad(ref)(x)), rtol=1e-4, atol=1e-6
    )
    compiled = mx.compile(mx.value_and_grad(ours))(x)
    assert compiled[0].item() == pytest.approx(ref(x).item(), rel=1e-5)
    np.testing.assert_allclose(np.array(compiled[1]), np.array(mx.grad(ref)(x)), atol=1e-6)


def test_softmax_keeps_dtype_and_nan():
    x = mx.random.normal((3, 40), key=mx.random.key(3)).astype(mx.bfloat16)
    out = cpu.softmax(x)
    assert out.dtype == mx.bfloat16
    assert rel(out.astype(mx.float32), mx.softmax(x.astype(mx.float32), axis=-1)) < 5e-3
    bad = mx.array([[0.0, mx.nan, 1.0], [0.0, 1.0, 2.0]])
    out = np.array(cpu.softmax(bad))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_swiglu_values_and_gradients(dtype):
    k = mx.random.split(mx.random.key(4), 3)
    gate = (5 * mx.random.normal((64, 96), key=k[0])).astype(dtype)
    gate = mx.concatenate([gate, mx.array([[100.0, -100.0, 0.0] * 32], dtype=dtype)])
    up = mx.random.normal(gate.shape, key=k[1]).astype(dtype)
    w = mx.random.normal(gate.shape, key=k[2])

    def ours(g, u):
        return (cpu.swiglu(g, u).astype(mx.float32) * w).sum()

    def ref(g, u):
        g, u = g.astype(mx.float32), u.astype(mx.float32)
        return (nn.silu(g) * u * w).sum()

    tol = 1e-5 if dtype == mx.float32 else 5e-3
    out = cpu.swiglu(gate, up)
    assert out.dtype == dtype
    assert rel(out.astype(mx.float32), nn.silu(gate.astype(mx.float32)) * up) < tol
    for a, b in zip(
        mx.grad(ours, argnums=(0, 1))(gate, up),
        mx.grad(ref, argnums=(0, 1))(gate, up),
        strict=True,
    ):
        assert a.dtype == dtype
        assert np.isfinite(np.array(a.astype(mx.float32))).all()
        assert rel(a.astype(mx.float32), b) < tol


CASES = [
    dict(causal=True, hq=4, hkv=4, seg=False, t=100),  # 3 query blocks of 34, 34, 32
    dict(causal=True, hq=4, hkv=2, seg=False, t=129),  # 4 blocks, the last of 30
    dict(causal=True, hq=4, hkv=2, seg=True, t=100),
    dict(causal=False, hq=4, hkv=1, seg=True, t=70),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_attention_blocks_match_naive(case):
    q, k, v = qkv(hq=case["hq"], hkv=case["hkv"], t=case["t"], seed=7)
    seg = segments(2, case["t"], seed=8) if case["seg"] else None
    if case["causal"]:
        assert len(cpu._blocks(case["t"], True)) > 1
    w = mx.random.normal(q.shape, key=mx.random.key(10))

    def ours(q, k, v):
        return (cpu.attention(q, k, v, 0.3, case["causal"], seg) * w).sum()

    def ref(q, k, v):
        return (naive(q, k, v, 0.3, case["causal"], seg) * w).sum()

    np.testing.assert_allclose(
        np.array(cpu.attention(q, k, v, 0.3, case["causal"], seg)),
        np.array(naive(q, k, v, 0.3, case["causal"], seg)),
        rtol=1e-4,
        atol=1e-5,
    )
    want = mx.grad(ref, argnums=(0, 1, 2))(q, k, v)
    for got in (
        mx.grad(ours, argnums=(0, 1, 2))(q, k, v),
        mx.compile(mx.grad(ours, argnums=(0, 1, 2)))(q, k, v),
    ):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_attention_bf16():
    q, k, v = qkv(hq=4, hkv=2, t=96, dtype=mx.bfloat16, seed=11)
    out = cpu.attention(q, k, v, 0.35)
    assert out.dtype == mx.bfloat16
    assert rel(out.astype(mx.float32), naive(q, k, v, 0.35, True, None)) < 1e-2
    w = mx.random.normal(q.shape, key=mx.random.key(13))
    grads = mx.grad(
        lambda q, k, v: (cpu.attention(q, k, v, 0.35).astype(mx.float32) * w).sum(), (0, 1, 2)
    )(q, k, v)
    assert [g.dtype for g in grads] == [mx.bfloat16] * 3
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    want = mx.grad(lambda q, k, v: (naive(q, k, v, 0.35, True, None) * w).sum(), (0, 1, 2))(*f32)
    for g, r in zip(grads, want, strict=True):
        assert rel(g, r) < 1e-2


def test_the_chunked_tier_gives_short_rows_to_it_on_the_cpu(monkeypatch):
    calls = []
    real = cpu.attention
    monkeypatch.setattr(cpu, "attention", lambda *a: calls.append(a[0].shape) or real(*a))
    q, k, v = qkv(hq=4, hkv=2, t=64, seed=12)
    assert flash.uses_fused(2, 4, 64)
    attention(q, k, v, scale=0.3, impl="chunked")
    assert calls == [q.shape]
    monkeypatch.setattr(flash, "FUSED_SCORES", 0)  # tiles: cpu.attention is not used
    attention(q, k, v, scale=0.3, impl="chunked")
    assert len(calls) == 1


def test_training_routes_swiglu_on_the_cpu_with_the_same_gradients(llama_dir):
    import mlx_lm.models.llama as llama_module

    from mlxtune.models import kernel_attention, load_model

    model, _ = load_model(llama_dir)
    x = mx.array([[5, 9, 2, 7, 1, 3, 8, 4] * 8])

    def loss(model):
        return (model(x).astype(mx.float32) ** 2).mean()

    plain = nn.value_and_grad(model, loss)(model)
    original = llama_module.swiglu
    with kernel_attention(model, "reference"):  # the naive tier keeps mlx-lm's swiglu
        assert llama_module.swiglu is original
    with kernel_attention(model):
        assert llama_module.swiglu is not original
        routed = nn.value_and_grad(model, loss)(model)
    assert llama_module.swiglu is original
    assert routed[0].item() == pytest.approx(plain[0].item(), rel=1e-5)
    flat = dict(nn.utils.tree_flatten(routed[1]))
    for name, g in nn.utils.tree_flatten(plain[1]):
        assert rel(flat[name], g) < 1e-4, name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_keeps_large_buffers_in_the_heap():
    """After ``import mlxtune`` a 64 MiB buffer comes from the heap, which keeps it once freed;
    with MLXTUNE_MALLOC=system glibc maps it fresh (and unmaps it on free): 64 MiB is above the
    most that glibc's own threshold ever rises to (32 MiB), whatever an import freed before."""
    code = """if True:
        import ctypes, os
        import mlxtune, mlxtune._malloc as m
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        p = libc.malloc(64 << 20)
        heap = [l for l in open("/proc/self/maps") if l.rstrip().endswith("[heap]")]
        lo, hi = (int(x, 16) for x in heap[0].split()[0].split("-"))
        print(lo <= p < hi, m.STATUS)
    """
    import os

    def run(env):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        )
        return out.stdout.strip()

    assert run({}).startswith("True glibc malloc keeps freed buffers")
    assert run({"MLXTUNE_MALLOC": "system"}) == "False system allocator (MLXTUNE_MALLOC=system)"


def test_the_cpu_evaluates_nearly_depth_first_unless_told_otherwise():
    """``import mlxtune`` on MLX's CPU backend sets MLX's evaluation width to 4 (what it does
    to a checkpointed step's peak: tests/test_memory.py; to the chunked loss called eagerly:
    tests/test_kernels.py); a width set outside is kept."""
    import os

    code = "import os, mlxtune, mlxtune._schedule as s; print(os.environ[s.VARIABLE], s.STATUS)"

    def run(width):
        env = {k: v for k, v in os.environ.items() if k != "MLX_BFS_MAX_WIDTH"}
        if width is not None:
            env["MLX_BFS_MAX_WIDTH"] = width
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        return out.stdout.strip()

    assert run(None) == "4 MLX_BFS_MAX_WIDTH=4: near depth-first evaluation on the CPU"
    assert run("7") == "7 MLX_BFS_MAX_WIDTH=7 (set outside mlxtune)"


def test_logsumexp_and_dispatch(monkeypatch):
    z = 6 * mx.random.normal((33, 1000), key=mx.random.key(13))
    got = mx.compile(cpu.logsumexp)(z)
    np.testing.assert_allclose(np.array(got), np.array(mx.logsumexp(z, axis=-1)), rtol=1e-6)
    x = -mx.abs(z)
    assert cpu.on_cpu()
    fast = np.array(cpu.exp_of_nonpositive(x))
    np.testing.assert_allclose(fast, np.exp(np.array(x, np.float64)), rtol=1e-6, atol=1e-38)
    assert not np.array_equal(fast, np.array(mx.exp(x)))  # not MLX's own
    monkeypatch.setattr(cpu, "on_cpu", lambda: False)  # elsewhere: MLX's own
    np.testing.assert_array_equal(np.array(cpu.exp_of_nonpositive(x)), np.array(mx.exp(x)))
    np.testing.assert_array_equal(np.array(cpu.logsumexp(z)), np.array(mx.logsumexp(z, axis=-1)))


def test_tanh_matches_float64():
    x = mx.concatenate([mx.linspace(-30.0, 30.0, 100_001), mx.array([0.0, -0.0, 1e-8, -1e-8])])
    got = np.array(mx.compile(cpu.tanh)(x), np.float64)
    want = np.tanh(np.array(x, np.float64))
    assert np.max(np.abs(got - want)) < 2e-7
    assert cpu.tanh(mx.array([0.5], dtype=mx.bfloat16)).dtype == mx.bfloat16


def test_kernel_attention_nests_and_restores_after_errors(llama_dir):
    import mlx_lm.models.llama as llama_module

    from mlxtune.models import kernel_attention, load_model

    model, _ = load_model(llama_dir)
    sdpa, swiglu = llama_module.scaled_dot_product_attention, llama_module.swiglu
    outer = kernel_attention(model)
    with outer:
        patched = (llama_module.scaled_dot_product_attention, llama_module.swiglu)
        assert patched[0] is not sdpa and patched[1] is not swiglu
        with kernel_attention(model, "reference"):
            assert llama_module.swiglu is swiglu  # the naive tier: mlx-lm's own
        with outer:  # re-entered: the inner exit leaves the outer patch in place
            pass
        assert (llama_module.scaled_dot_product_attention, llama_module.swiglu) == patched
        with pytest.raises(ValueError), kernel_attention(model, "chunked"):
            raise ValueError("a failing step")
        assert (llama_module.scaled_dot_product_attention, llama_module.swiglu) == patched
    assert llama_module.scaled_dot_product_attention is sdpa and llama_module.swiglu is swiglu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_trim_gives_freed_heap_pages_back():
    """A freed 64 MiB buffer stays in the process (setup_malloc keeps it in the heap) until
    _malloc.trim hands its pages back: the process's resident memory, read from /proc, drops by
    about that much."""
    code = """if True:
        import ctypes, os
        import mlxtune, mlxtune._malloc as m
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        p = libc.malloc(64 << 20)
        ctypes.memset(p, 1, 64 << 20)
        libc.free(ctypes.c_void_p(p))
        kept = rss()
        given = m.trim()
        print(given, (kept - rss()) >> 20)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    given, dropped_mib = out.stdout.split()
    assert given == "True"
    assert int(dropped_mib) >= 56, out.stdout


def test_compiled_attention_backward_keeps_no_probabilities_per_layer():
    """Compiled, the backward's recomputed probabilities are not merged with the forward's (which
    would keep every layer's until its backward): a stack of layers grows by far less than one
    layer's probabilities per layer added."""
    b, h, t, d = 1, 4, 512, 32

    def stack(layers):
        def loss(ws, x):
            for w in ws:
                q = (x @ w).reshape(b, t, h, d).transpose(0, 2, 1, 3)
                o = cpu.attention(q, q, q, d**-0.5)
                x = x + o.transpose(0, 2, 1, 3).reshape(b, t, h * d)
            return (x * x).sum()

        ws = [mx.random.normal((h * d, h * d), key=mx.random.key(i)) * 0.05 for i in range(layers)]
        x = mx.random.normal((b, t, h * d), key=mx.random.key(99))
        mx.eval(ws, x)
        return peak_memory_mb(mx.compile(mx.grad(loss)), ws, x)

    probabilities_mb = b * h * t * t * 4 / 1e6  # one layer's, fp32 (4.2 MB)
    per_layer = (stack(5) - stack(1)) / 4
    assert per_layer < probabilities_mb / 2, (per_layer, probabilities_mb)
