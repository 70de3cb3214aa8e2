"""attention: each tier against a naive MLX reference built from mx.softmax, in values and
gradients: causal and not, GQA, packed segments, sizes that are not multiples of the block."""

import ctypes
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import peak_memory_mb
from mlxtune.kernels import ATTENTION_IMPLS, attention, flash
from mlxtune.kernels.flash import attention_chunked
from mlxtune.models import kernel_attention


def naive(q, k, v, scale, causal, seg):
    """Expand the kv heads, build the full scores and mask, softmax: no shared code with the tiers."""
    rep = q.shape[1] // k.shape[1]
    k = mx.repeat(k, rep, axis=1).astype(mx.float32)
    v = mx.repeat(v, rep, axis=1).astype(mx.float32)
    s = (q.astype(mx.float32) @ k.swapaxes(-1, -2)) * scale
    t = q.shape[2]
    allowed = mx.ones((1, 1, t, t), dtype=mx.bool_)
    if causal:
        allowed = allowed & mx.tril(mx.ones((t, t), dtype=mx.bool_))[None, None]
    if seg is not None:
        allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    s = mx.where(allowed, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ v


def qkv(b=2, hq=4, hkv=2, t=37, d=8, dtype=mx.float32, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((b, hq, t, d), key=k1).astype(dtype),
        mx.random.normal((b, hkv, t, d), key=k2).astype(dtype),
        mx.random.normal((b, hkv, t, d), key=k3).astype(dtype),
    )


def segments(b, t, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=3, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right"))
    return mx.array(np.stack(rows).astype(np.int32))


CASES = [
    dict(causal=True, hq=4, hkv=4, seg=False),
    dict(causal=True, hq=4, hkv=2, seg=False),
    dict(causal=False, hq=4, hkv=1, seg=False),
    dict(causal=True, hq=4, hkv=2, seg=True),
    dict(causal=False, hq=2, hkv=2, seg=True),
]


IMPLS = sorted(ATTENTION_IMPLS) + ["chunked-tiles"]  # chunked: short rows go to MLX's fused


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"causal={c['causal']}-hq{c['hq']}-hkv{c['hkv']}-seg={c['seg']}"
)
def test_values_and_gradients_match_naive(impl, case, monkeypatch):
    if impl == "chunked-tiles":  # every size takes the tiles
        monkeypatch.setattr(flash, "FUSED_SCORES", 0)
        impl = "chunked"
    q, k, v = qkv(hq=case["hq"], hkv=case["hkv"], t=37, seed=1)
    seg = segments(2, 37) if case["seg"] else None
    scale = 8**-0.5
    w = mx.random.normal(q.shape, key=mx.random.key(9))  # a non-uniform cotangent

    def ours(q, k, v):
        return (
            attention(q, k, v, scale=scale, causal=case["causal"], segment_ids=seg, impl=impl) * w
        ).sum()

    def ref(q, k, v):
        return (naive(q, k, v, scale, case["causal"], seg) * w).sum()

    np.testing.assert_allclose(
        np.array(
            attention(q, k, v, scale=scale, causal=case["causal"], segment_ids=seg, impl=impl)
        ),
        np.array(naive(q, k, v, scale, case["causal"], seg)),
        rtol=1e-4,
        atol=1e-5,
    )
    for a, b in zip(
        mx.grad(ours, argnums=(0, 1, 2))(q, k, v),
        mx.grad(ref, argnums=(0, 1, 2))(q, k, v),
        strict=True,
    ):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [5, 16, 64])
def test_chunked_blocks_that_do_not_divide_t(block):
    q, k, v = qkv(hq=4, hkv=2, t=37, seed=2)
    seg = segments(2, 37, seed=3)
    scale = 0.3

    def ours(q, k, v):
        return (attention_chunked(q, k, v, scale, True, seg, block=block) ** 2).sum()

    def ref(q, k, v):
        return (naive(q, k, v, scale, True, seg) ** 2).sum()

    assert ours(q, k, v).item() == pytest.approx(ref(q, k, v).item(), rel=1e-5)
    for a, b in zip(
        mx.grad(ours, argnums=(0, 1, 2))(q, k, v),
        mx.grad(ref, argnums=(0, 1, 2))(q, k, v),
        strict=True,
    ):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_bf16_inputs():
    q, k, v = qkv(hq=4, hkv=2, t=40, dtype=mx.bfloat16, seed=4)
    out = attention(q, k, v, scale=0.35, impl="chunked")
    ref = naive(q, k, v, 0.35, True, None)
    assert out.dtype == mx.bfloat16
    err = np.linalg.norm(np.array(out.astype(mx.float32)) - np.array(ref)) / np.linalg.norm(
        np.array(ref)
    )
    assert err < 1e-2


def test_segments_do_not_see_each_other():
    q, k, v = qkv(b=1, hq=2, hkv=2, t=12, seed=5)
    seg = mx.array([[0] * 5 + [1] * 7])
    base = attention(q, k, v, scale=0.5, segment_ids=seg, impl="chunked")
    v2 = mx.concatenate([v[:, :, :5] + 10.0, v[:, :, 5:]], axis=2)  # change segment 0 only
    moved = attention(q, k, v2, scale=0.5, segment_ids=seg, impl="chunked")
    np.testing.assert_allclose(np.array(moved[:, :, 5:]), np.array(base[:, :, 5:]), atol=1e-6)
    assert np.abs(np.array(moved[:, :, :5] - base[:, :, :5])).min() > 1.0


def test_bad_shapes():
    q, k, v = qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attention(q, k, v, scale=1.0)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="segment_ids"):
        attention(q, k, v, scale=1.0, segment_ids=mx.zeros((2, 5), dtype=mx.int32))


def test_chunked_backward_memory_grows_linearly_not_quadratically(monkeypatch):
    def peak(impl, t):
        q, k, v = qkv(b=1, hq=4, hkv=2, t=t, d=32, seed=6)
        f = lambda q, k, v: attention(q, k, v, scale=0.2, impl=impl).sum()  # noqa: E731
        g = mx.compile(lambda q, k, v: mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v))
        return peak_memory_mb(g, q, k, v)

    ref = {t: peak("reference", t) for t in (512, 1024)}
    # 1 x 4 x 512 x 512 scores: within the default budget, MLX's fused attention builds them in
    # its backward, as the reference does
    assert flash.uses_fused(1, 4, 512)
    fused = peak("chunked", 512)
    monkeypatch.setattr(flash, "FUSED_SCORES", 0)  # slabs at every size
    monkeypatch.setattr(flash, "SLAB_AREA", 4 * 64 * 64)  # 64-query slabs: T x block grows
    tiles = {t: peak("chunked", t) for t in (512, 1024)}
    assert ref[1024] > 3 * ref[512]  # the [T, T] scores
    assert tiles[1024] < 2.5 * tiles[512]
    assert tiles[1024] < 0.3 * ref[1024]
    assert fused > 0.5 * ref[512] and tiles[512] < 0.5 * fused


def test_slabs_are_sized_by_the_heads_not_the_row():
    """Queries per slab: a multiple of 64 near sqrt(SLAB_AREA / (B x Hq)), whatever T is, and no
    more than the row (rounded up to 64)."""
    for b, hq in ((1, 9), (1, 32), (4, 8), (8, 32), (1, 1)):
        want = (flash.SLAB_AREA / (b * hq)) ** 0.5
        for t in (100, 2048, 4096, 8192, 16384, 32768, 65536):
            blk = flash.block_for(b, hq, t)
            assert blk % flash.BLOCK == 0 and flash.BLOCK <= blk <= -(-t // 64) * 64
            if blk < -(-t // 64) * 64 and blk > flash.BLOCK:  # neither bound: the nearest
                assert abs(blk - want) <= flash.BLOCK / 2, (b, hq, t, blk)
    assert flash.block_for(1, 9, 4096) == flash.block_for(1, 9, 32768) == 128


def test_a_deeper_model_gets_larger_slabs():
    """A step holds every layer's graph but one layer's slab at a time: the slab area grows with
    the layers past SLAB_LAYERS (30 layers at 9 heads: 256 queries, sqrt(2^17 x 30 / 8 / 9) =
    234 rounded to 64), and a model's steps read its layer count inside kernel_attention."""

    class Deep(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.layers = [nn.Linear(2, 2) for _ in range(n)]

    assert flash.block_for(1, 9, 8192, layers=30) == 256
    assert flash.block_for(1, 9, 8192, layers=4) == flash.block_for(1, 9, 8192) == 128
    with kernel_attention(Deep(30)):
        assert flash.block_for(1, 9, 8192) == 256
        with kernel_attention(Deep(2)):  # nested: the inner model's, then back
            assert flash.block_for(1, 9, 8192) == 128
        assert flash.block_for(1, 9, 8192) == 256
    assert flash.block_for(1, 9, 8192) == 128


def _heap_bytes() -> int:
    """glibc's bytes in use (mallinfo2), where MLX's graph nodes live."""

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    return libc.mallinfo2().uordblks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's mallinfo2")
def test_the_graph_of_a_layer_grows_with_the_row_not_its_square(monkeypatch):
    """The chunked tier unrolls its slabs into the step's graph, which MLX holds beside the
    arrays while a step runs (as the compiled tape, and again as the call's arrays). Built, not
    run, at 4 heads: the backward graph of a row 4x as long takes about 4x the memory (square
    tiles took 16x: 4 GB at SmolLM2's 8k rows)."""
    monkeypatch.setattr(flash, "FUSED_SCORES", 0)

    def graph_bytes(t):
        q, k, v = qkv(b=1, hq=4, hkv=2, t=t, d=8, seed=12)
        mx.eval(q, k, v)
        f = lambda q, k, v: attention(q, k, v, scale=0.3, impl="chunked").sum()  # noqa: E731
        before = _heap_bytes()
        held = mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)  # noqa: F841 (the graph)
        return _heap_bytes() - before

    assert flash.block_for(1, 4, 8192) == 192
    small, large = graph_bytes(2048), graph_bytes(8192)
    assert small > 0 and large < 6 * small, (small, large)


def test_chunked_attention_with_grown_blocks_matches_the_reference(monkeypatch):
    """Slabs of the blocks block_for sizes (T=1100 at 2 heads: 256 queries, a ragged last one),
    values and gradients against the naive form, causal and packed."""
    b, hq, hkv, t, d = 1, 2, 1, 1100, 16
    monkeypatch.setattr(flash, "FUSED_SCORES", 0)  # slabs, not the scores built whole
    assert flash.block_for(b, hq, t) == 256
    q, k, v = qkv(b=b, hq=hq, hkv=hkv, t=t, d=d, seed=11)
    seg = mx.array(np.repeat(np.arange(1, 4), [400, 500, 200])[None].astype(np.int32))
    for segments in (None, seg):

        def loss(impl, segments=segments):
            def f(q, k, v):
                out = attention(q, k, v, scale=0.25, segment_ids=segments, impl=impl)
                return (out * out).sum()

            return mx.value_and_grad(f, argnums=(0, 1, 2))

        want = loss("reference")(q, k, v)
        got = loss("chunked")(q, k, v)
        assert abs(got[0].item() - want[0].item()) <= 1e-4 * abs(want[0].item())
        for a, r in zip(got[1], want[1], strict=True):
            a, r = np.array(a), np.array(r)
            assert np.abs(a - r).max() <= 1e-4 * np.abs(r).max()
