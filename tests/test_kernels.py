"""linear_cross_entropy against a naive MLX reference built from mlx.nn.losses, values and
gradients."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from conftest import peak_memory_mb
from mlxtune.kernels import available_impls, linear_cross_entropy

IGNORE = -100


def naive(hidden, weight, targets, label_smoothing=0.0, softcap=None):
    logits = hidden.astype(mx.float32) @ weight.astype(mx.float32).T
    if softcap is not None:
        logits = softcap * mx.tanh(logits / softcap)
    valid = targets != IGNORE
    ce = nn.losses.cross_entropy(
        logits, mx.where(valid, targets, 0), label_smoothing=label_smoothing, reduction="none"
    )
    return (ce * valid).sum(), valid.sum()


def inputs(n=37, d=16, v=29, dtype=mx.float32, seed=0, ignored=5):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    h = mx.random.normal((n, d), key=k1).astype(dtype)
    w = (0.3 * mx.random.normal((v, d), key=k2)).astype(dtype)
    t = mx.random.randint(0, v, (n,), key=k3)
    t = mx.where(mx.arange(n) % 7 == 0, IGNORE, t) if ignored else t
    return h, w, t


@pytest.mark.parametrize("impl", available_impls())
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_values_and_gradients_match_naive_fp32(impl, label_smoothing, softcap):
    h, w, t = inputs(seed=1)

    def f(h, w):
        return linear_cross_entropy(
            h, w, t, label_smoothing=label_smoothing, softcap=softcap, impl=impl
        )[0]

    def g(h, w):
        return naive(h, w, t, label_smoothing, softcap)[0]

    loss, n = linear_cross_entropy(
        h, w, t, label_smoothing=label_smoothing, softcap=softcap, impl=impl
    )
    ref, ref_n = naive(h, w, t, label_smoothing, softcap)
    assert n.item() == ref_n.item() == int((np.array(t) != IGNORE).sum())
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    gh, gw = mx.grad(f, argnums=(0, 1))(h, w)
    rh, rw = mx.grad(g, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(np.array(gh), np.array(rh), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(gw), np.array(rw), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", available_impls())
def test_bf16_inputs_accumulate_in_fp32(impl):
    h, w, t = inputs(seed=2, dtype=mx.bfloat16)
    loss, _ = linear_cross_entropy(h, w, t, impl=impl)
    ref, _ = naive(h, w, t)
    assert loss.dtype == mx.float32
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    gh = mx.grad(lambda h: linear_cross_entropy(h, w, t, impl=impl)[0])(h)
    rh = mx.grad(lambda h: naive(h, w, t)[0])(h)
    rh = np.array(rh.astype(mx.float32))
    err = np.linalg.norm(np.array(gh.astype(mx.float32)) - rh) / np.linalg.norm(rh)
    assert err < 2e-2


def test_reductions_and_ignored_rows():
    h, w, t = inputs(seed=3)
    per, n = linear_cross_entropy(h, w, t, reduction="none")
    total, _ = linear_cross_entropy(h, w, t, reduction="sum")
    mean, _ = linear_cross_entropy(h, w, t, reduction="mean")
    assert per.shape == (h.shape[0],)
    assert (np.array(per)[np.array(t) == IGNORE] == 0).all()
    assert abs(per.sum().item() - total.item()) < 1e-4
    assert abs(mean.item() - total.item() / n.item()) < 1e-6


def test_gradient_of_ignored_rows_is_zero():
    h, w, t = inputs(seed=4)
    gh = mx.grad(lambda h: linear_cross_entropy(h, w, t)[0])(h)
    ignored = np.array(t) == IGNORE
    assert ignored.any() and (np.array(gh)[ignored] == 0).all()


def test_bad_arguments():
    h, w, t = inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(ValueError, match="shapes"):
        linear_cross_entropy(h, w[:, :3], t)
    with pytest.raises(ValueError, match="unknown kernel tier 'nonexistent'"):
        linear_cross_entropy(h, w, t, impl="nonexistent")
    if "cuda" not in available_impls():
        with pytest.raises(ValueError, match="need MLX's cuda backend.*available here: reference"):
            linear_cross_entropy(h, w, t, impl="cuda")


@pytest.mark.parametrize(
    "label_smoothing, softcap", [(0.0, None), (0.2, None), (0.0, 3.0), (0.1, 5.0)]
)
@pytest.mark.parametrize("chunk", [8, 16, 29])  # 29: one chunk; 8: a last chunk of 5
def test_chunked_tier_over_many_uneven_chunks_matches_reference(chunk, label_smoothing, softcap):
    from mlxtune.kernels.chunked import linear_cross_entropy_chunked
    from mlxtune.kernels.reference import linear_cross_entropy_reference

    h, w, t = inputs(n=45, d=12, v=29, seed=5)

    def run(fn, h, w):
        losses, _ = fn(h, w, t, IGNORE, label_smoothing, softcap)
        return (losses * mx.linspace(0.5, 1.5, losses.shape[0])).sum()  # a non-uniform cotangent

    ours = lambda h, w: run(lambda *a: linear_cross_entropy_chunked(*a, chunk=chunk), h, w)  # noqa: E731
    ref = lambda h, w: run(linear_cross_entropy_reference, h, w)  # noqa: E731
    assert ours(h, w).item() == pytest.approx(ref(h, w).item(), rel=1e-5)
    go = mx.grad(ours, argnums=(0, 1))(h, w)
    gr = mx.grad(ref, argnums=(0, 1))(h, w)
    for a, b in zip(go, gr, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-6)


def test_chunked_tier_in_bf16_over_chunks():
    from mlxtune.kernels.chunked import linear_cross_entropy_chunked

    h, w, t = inputs(n=64, d=16, v=300, seed=6, dtype=mx.bfloat16)
    losses, _ = linear_cross_entropy_chunked(h, w, t, IGNORE, 0.0, None, chunk=64)
    ref, _ = naive(h, w, t)
    assert losses.dtype == mx.float32
    assert abs(losses.sum().item() - ref.item()) <= 1e-2 * abs(ref.item())
    gw = mx.grad(
        lambda w: linear_cross_entropy_chunked(h, w, t, IGNORE, 0.0, None, chunk=64)[0].sum()
    )(w)
    rw = np.array(mx.grad(lambda w: naive(h, w, t)[0])(w).astype(mx.float32))
    assert gw.dtype == mx.bfloat16
    assert np.linalg.norm(np.array(gw.astype(mx.float32)) - rw) / np.linalg.norm(rw) < 2e-2


def test_chunked_tier_never_builds_the_logits(monkeypatch):
    """Measured, not assumed: the compiled forward+backward (hidden and head) of the chunked
    tier peaks at a few chunks whatever the vocabulary, while the reference grows with it."""
    from mlxtune.kernels import chunked as chunked_mod

    monkeypatch.setattr(chunked_mod, "CHUNK_ELEMENTS", 1 << 17)  # 0.5 MB chunks
    peaks = {}
    for v in (8192, 16384):
        h, w, t = inputs(n=512, d=32, v=v, seed=7, ignored=0)
        for impl in ("chunked", "reference"):
            f = lambda h, w, impl=impl, t=t: linear_cross_entropy(h, w, t, impl=impl)[0]  # noqa: E731
            peaks[impl, v] = peak_memory_mb(
                mx.compile(lambda h, w, f=f: mx.value_and_grad(f, argnums=(0, 1))(h, w)), h, w
            )
    logits_mb = 512 * 16384 * 4 / 1e6
    assert (
        peaks["reference", 16384] > logits_mb
        and peaks["reference", 16384] > 1.7 * peaks["reference", 8192]
    )
    assert peaks["chunked", 16384] < 0.5 * logits_mb
    assert peaks["chunked", 16384] < 0.2 * peaks["reference", 16384]
    # what grows with V is the weight's gradient ([V, D]), not the logits
    grad_mb = 8192 * 32 * 4 / 1e6
    assert peaks["chunked", 16384] - peaks["chunked", 8192] < 3 * grad_mb
    # a frozen head gathers d hidden during the forward, still one chunk at a time
    for v in (8192, 16384):
        h, w, t = inputs(n=512, d=32, v=v, seed=7, ignored=0)
        f = lambda h, w, t=t: linear_cross_entropy(h, w, t, weight_grad=False)[0]  # noqa: E731
        peaks["frozen", v] = peak_memory_mb(mx.compile(mx.value_and_grad(f)), h, w)
    assert peaks["frozen", 16384] < 0.2 * logits_mb
    assert peaks["frozen", 16384] < 1.3 * peaks["frozen", 8192]


def test_the_chunked_loss_keeps_its_peak_called_eagerly_as_compiled():
    """The promise holds in both modes: at N=2048, D=64, V=32768 (the value and both
    gradients), the chunked tier's measured peak is under a fifth of the naive path's, called
    eagerly (as a library user would) and compiled (each chunk's logits only once the chunk
    before is folded in: MLX's scheduler would otherwise build them all at once)."""
    h, w, t = inputs(n=2048, d=64, v=32768, seed=3, ignored=0)

    def grads(impl):
        f = lambda h, w: linear_cross_entropy(h, w, t, impl=impl)[0]  # noqa: E731
        return mx.value_and_grad(f, argnums=(0, 1))

    naive = peak_memory_mb(grads("reference"), h, w)
    eager = peak_memory_mb(grads("chunked"), h, w)
    compiled = peak_memory_mb(mx.compile(grads("chunked")), h, w)
    assert naive > 2048 * 32768 * 4 / 1e6  # it builds the logits
    assert eager < 0.2 * naive, (eager, naive)
    assert compiled < 0.2 * naive, (compiled, naive)


def test_impl_is_chosen_by_argument_environment_and_default(monkeypatch):
    from mlxtune import kernels

    monkeypatch.delenv("MLXTUNE_KERNELS", raising=False)
    assert kernels._pick(None) == kernels.best_impl() == "chunked"
    assert kernels.resolve("auto") == kernels.resolve(None) == "chunked"
    monkeypatch.setenv("MLXTUNE_KERNELS", "reference")
    assert kernels._pick(None) == kernels.resolve("auto") == "reference"
    assert kernels._pick("chunked") == kernels.resolve("chunked") == "chunked"
    monkeypatch.setenv("MLXTUNE_KERNELS", "fast")
    with pytest.raises(ValueError, match="MLXTUNE_KERNELS=fast: unknown kernel tier 'fast'"):
        kernels.resolve("auto")
    assert kernels.resolve("chunked") == "chunked"  # a tier named by the caller wins
    with pytest.raises(ValueError, match="unknown kernel tier 'tiled'; .*use auto"):
        kernels.resolve("tiled")


def test_frozen_head_skips_the_weight_gradient_but_not_the_hidden_one():
    h, w, t = inputs(n=40, d=12, v=50, seed=8)

    def f(weight_grad):
        return lambda h, w: linear_cross_entropy(h, w, t, impl="chunked", weight_grad=weight_grad)[
            0
        ]

    gh, gw = mx.grad(f(True), argnums=(0, 1))(h, w)
    fh, fw = mx.grad(f(False), argnums=(0, 1))(h, w)
    np.testing.assert_allclose(np.array(fh), np.array(gh), rtol=1e-5, atol=1e-7)
    assert not np.array(fw).any() and np.array(gw).any()


def naive_per_token(hidden, weight, targets, label_smoothing=0.0, softcap=None):
    """[N] losses from the full logits (0 where ignored), float64 NumPy."""
    h, w = np.array(hidden, dtype=np.float64), np.array(weight, dtype=np.float64)
    t = np.array(targets)
    z = h @ w.T
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    valid = t != IGNORE
    zt = z[np.arange(len(t)), np.where(valid, t, 0)]
    nll = (1 - label_smoothing) * (lse - zt) + label_smoothing * (lse - z.mean(axis=1))
    return np.where(valid, nll, 0.0)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_frozen_head_gathers_its_hidden_gradient_in_the_forward(label_smoothing, softcap):
    """weight_grad=False: the forward carries sum_v p_v W_v along (rescaled as the running
    maximum grows over the chunks) and the backward uses it; per-token losses and d hidden for
    an uneven per-token cotangent match float64 NumPy, and so does forward_only()."""
    from mlxtune.kernels import forward_only
    from mlxtune.kernels.chunked import linear_cross_entropy_chunked

    n, d, v = 33, 12, 1000
    h, w, t = inputs(n=n, d=d, v=v, seed=9)
    w = w * mx.linspace(0.2, 3.0, v)[:, None]  # logits grow chunk by chunk: m moves
    cot = mx.random.uniform(0.5, 2.0, (n,), key=mx.random.key(4))

    def losses(h, w):
        return linear_cross_entropy_chunked(
            h, w, t, IGNORE, label_smoothing, softcap, chunk=256, weight_grad=False
        )[0]

    got, (gh, gw) = mx.vjp(losses, [h, w], [cot])
    got = got[0]
    want = naive_per_token(h, w, t, label_smoothing, softcap)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=2e-5)
    assert not np.array(gw).any()  # the frozen head's gradient is skipped

    # d hidden in float64: d/dh sum_i cot_i loss_i by central differences of the exact loss
    def total(hh):
        return (
            np.array(cot, dtype=np.float64) * naive_per_token(hh, w, t, label_smoothing, softcap)
        ).sum()

    h64 = np.array(h, dtype=np.float64)
    want_gh = np.zeros_like(h64)
    eps = 1e-6
    for i in range(n):
        for j in range(d):
            up, down = h64.copy(), h64.copy()
            up[i, j] += eps
            down[i, j] -= eps
            want_gh[i, j] = (total(up) - total(down)) / (2 * eps)
    np.testing.assert_allclose(np.array(gh), want_gh, rtol=1e-4, atol=1e-5)

    with forward_only():
        plain = linear_cross_entropy(
            h,
            w,
            t,
            label_smoothing=label_smoothing,
            softcap=softcap,
            reduction="none",
            impl="chunked",
            weight_grad=False,
        )[0]
    np.testing.assert_allclose(np.array(plain), want, rtol=2e-5, atol=2e-5)


def test_a_gpu_takes_larger_chunks_of_logits(monkeypatch):
    """2**20 logits a chunk on the CPU, 2**24 on a GPU: at N=4096 and V=152064 256 columns
    (594 chunks) against 4096 (38)."""
    from mlxtune.kernels import chunked as chunked_mod

    assert chunked_mod.chunk_size(4096, 152064) == 256
    monkeypatch.setattr(chunked_mod.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert chunked_mod.chunk_size(4096, 152064) == 4096
    assert chunked_mod.chunk_size(4096, 1000) == 1000  # at most the vocabulary


def _numpy_loss_and_grad(h, w, t, label_smoothing, softcap, scale):
    """Summed cross-entropy of h @ (scale w).T and its gradient in h, in float64."""
    h, w, t = np.array(h, np.float64), scale * np.array(w, np.float64), np.array(t)
    z = h @ w.T
    dz_draw = np.ones_like(z)
    if softcap is not None:
        dz_draw = 1 - np.tanh(z / softcap) ** 2
        z = softcap * np.tanh(z / softcap)
    valid = t != IGNORE
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    safe = np.where(valid, t, 0)
    nll = lse - z[np.arange(len(t)), safe]
    smooth = lse - z.mean(axis=1)
    loss = ((1 - label_smoothing) * nll + label_smoothing * smooth) * valid
    onehot = np.zeros_like(z)
    onehot[np.arange(len(t)), safe] = 1
    dz = (p - (1 - label_smoothing) * onehot - label_smoothing / z.shape[1]) * valid[:, None]
    return loss.sum(), (dz * dz_draw) @ w


@pytest.mark.parametrize("impl", available_impls())
@pytest.mark.parametrize(
    "label_smoothing,softcap,scale,mode",
    [(0.0, None, 1.0, "affine"), (0.1, 4.0, 0.25, "affine"), (0.0, None, 1.0, "mxfp4")],
)
def test_a_quantized_head_read_a_chunk_of_rows_at_a_time_is_its_de_quantized_head(
    impl, label_smoothing, softcap, scale, mode
):
    """A frozen quantized head as QuantizedRows (each chunk de-quantizes its own rows) gives the
    loss and hidden-state gradient of the de-quantized head, in every tier; on the chunked tier
    without ever building that head (the step's peak under half of it)."""
    from mlxtune.kernels import QuantizedRows

    n, d, v = 37, 128, 3000
    h, w, t = inputs(n=n, d=d, v=v, seed=4)
    group = 64 if mode == "affine" else 32
    codes, scales, *biases = mx.quantize(w, group_size=group, bits=4, mode=mode)
    biases = biases[0] if biases else None
    rows = QuantizedRows(codes, scales, biases, group, 4, mode=mode, scale=scale)
    deq = mx.dequantize(codes, scales, biases, group, 4, mode=mode).astype(mx.float32)
    want, want_dh = _numpy_loss_and_grad(h, deq, t, label_smoothing, softcap, scale)

    def f(h):
        return linear_cross_entropy(
            h, rows, t, label_smoothing=label_smoothing, softcap=softcap, impl=impl,
            weight_grad=False,
        )[0]  # fmt: skip

    loss, dh = mx.value_and_grad(f)(h)
    assert abs(loss.item() - want) <= 1e-5 * abs(want)
    np.testing.assert_allclose(np.array(dh), want_dh, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="does not train"):
        linear_cross_entropy(h, rows, t, impl="chunked", weight_grad=True)


def test_a_quantized_heads_chunked_loss_never_holds_the_dense_head():
    from mlxtune.kernels import QuantizedRows

    n, d, v = 256, 1024, 65536  # the dense head: 256 MB in fp32
    h, w, t = inputs(n=n, d=d, v=v, seed=5, ignored=0)
    codes, scales, biases = mx.quantize(w, group_size=64, bits=4)
    mx.eval(h, t, codes, scales, biases)
    del w
    rows = QuantizedRows(codes, scales, biases, 64, 4)
    step = mx.compile(
        mx.value_and_grad(
            lambda h: linear_cross_entropy(h, rows, t, impl="chunked", weight_grad=False)[0]
        )
    )
    peak = peak_memory_mb(lambda: step(h))
    assert peak < 0.5 * v * d * 4 / 2**20, peak


def naive_entropy(hidden, weight, softcap=None):
    """[N] entropies of softmax(hidden @ weight.T) from the full logits, float64 NumPy:
    logsumexp(z) - sum softmax(z) z."""
    h, w = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (hidden, weight))
    z = h @ w.T
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    return lse - (p * z).sum(axis=1)


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("chunk", [None, 256, 7])  # V=1000: 3 x 256 + 232; 142 x 7 + 6
def test_linear_entropy_is_the_entropy_of_the_full_logits(softcap, chunk):
    """Per-row entropies over vocabulary chunks (the running maximum moving chunk by chunk)
    match float64 NumPy over the full logits, from near-uniform rows to near-certain ones; no
    gradient flows through them."""
    from mlxtune.kernels import linear_entropy

    n, d, v = 40, 12, 1000
    h, w, _ = inputs(n=n, d=d, v=v, seed=11)
    h = h * mx.linspace(0.05, 6.0, n)[:, None]  # entropies from about log V down to about 0
    w = w * mx.linspace(0.2, 3.0, v)[:, None]  # logits grow chunk by chunk: m moves
    got = linear_entropy(h, w, softcap=softcap, chunk=chunk)
    want = naive_entropy(h, w, softcap)
    assert got.dtype == mx.float32 and got.shape == (n,)
    if softcap is None:  # the range the rows cover (a cap of 4 keeps them near log V)
        assert want.max() > 6.0 and want.min() < 0.5
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    gh, gw = mx.grad(lambda h, w: linear_entropy(h, w, softcap=softcap).sum(), (0, 1))(h, w)
    assert not np.array(gh).any() and not np.array(gw).any()
    with pytest.raises(ValueError, match="expected hidden"):
        linear_entropy(h, w[:, :5])


def test_linear_entropy_of_a_quantized_head_and_bf16_inputs():
    from mlxtune.kernels import QuantizedRows, linear_entropy

    h, w, _ = inputs(n=37, d=128, v=3000, seed=4)
    codes, scales, biases = mx.quantize(w, group_size=64, bits=4)
    rows = QuantizedRows(codes, scales, biases, 64, 4, scale=2.0)
    deq = 2.0 * mx.dequantize(codes, scales, biases, 64, 4)
    want = naive_entropy(h, deq)
    np.testing.assert_allclose(np.array(linear_entropy(h, rows)), want, rtol=1e-5, atol=1e-5)
    hb, wb = h.astype(mx.bfloat16), w.astype(mx.bfloat16)
    got = linear_entropy(hb, wb, chunk=512)
    assert got.dtype == mx.float32
    # the logits rounded to bf16 by the matmul, as the loss rounds them: within 1.5%
    np.testing.assert_allclose(np.array(got), naive_entropy(hb, wb), rtol=1.5e-2, atol=1e-3)


def test_linear_entropy_never_builds_the_logits(monkeypatch):
    """Measured, not assumed: at N=512, V=16384 (0.5 MB chunks) the entropies' peak is a small
    share of the [N, V] logits that the naive form builds."""
    from mlxtune.kernels import chunked as chunked_mod
    from mlxtune.kernels import linear_entropy

    monkeypatch.setattr(chunked_mod, "CHUNK_ELEMENTS", 1 << 17)
    monkeypatch.setattr(chunked_mod, "GPU_CHUNK_ELEMENTS", 1 << 17)
    h, w, _ = inputs(n=512, d=64, v=16384, seed=3, ignored=0)

    def naive_form(h, w):
        z = h @ w.T
        p = mx.softmax(z, axis=-1)
        return mx.logsumexp(z, axis=-1) - (p * z).sum(axis=-1)

    logits_mb = 512 * 16384 * 4 / 1e6
    naive = peak_memory_mb(naive_form, h, w)
    ours = peak_memory_mb(linear_entropy, h, w)
    assert naive > logits_mb, naive
    assert ours < 0.25 * logits_mb, (ours, naive)
