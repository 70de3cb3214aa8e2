"""The gated delta rule chunkwise (kernels/delta.py): values against a NumPy float64
recurrence, values and gradients against mlx-lm's own loop, packed examples restarting the
state (and the short convolution) as if each ran alone, and hybrid models routed through it
while training."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gated_delta as mlx_lm_delta

from mlxtune.kernels import delta
from mlxtune.models import kernel_attention
from mlxtune.models.context import segments


def recurrence64(q, k, v, g, beta, state):
    """The gated delta rule one position at a time in float64 (q, k already per value head)."""
    B, T, H, _ = q.shape
    s = state.copy()
    y = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            S = s[b, h]
            for t in range(T):
                decay = g[b, t, h] if g.ndim == 3 else g[b, t, h][None, :]
                S = S * decay
                d = (v[b, t, h] - S @ k[b, t, h]) * beta[b, t, h]
                S = S + np.outer(d, k[b, t, h])
                y[b, t, h] = S @ q[b, t, h]
            s[b, h] = S
    return y, s


def inputs(B=2, T=37, Hk=1, Hv=2, Dk=8, Dv=6, vector=False, seed=0, strongest=1.5):
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.standard_normal((B, T, Hk, Dk))) * Dk**-0.5
    k = unit(rng.standard_normal((B, T, Hk, Dk)))
    v = rng.standard_normal((B, T, Hv, Dv))
    log_g = -rng.uniform(0.01, strongest, (B, T, Hv, Dk) if vector else (B, T, Hv))
    beta = rng.uniform(0.05, 1.0, (B, T, Hv))
    state = 0.3 * rng.standard_normal((B, Hv, Dv, Dk))
    return q, k, v, log_g, beta, state


def f32(*xs):
    return [mx.array(np.asarray(x, np.float32)) for x in xs]


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("chunk", [4, 16, None])
def test_values_match_a_float64_recurrence(vector, chunk):
    q, k, v, log_g, beta, state = inputs(vector=vector)
    rep = v.shape[2] // q.shape[2]
    want_y, want_s = recurrence64(
        np.repeat(q, rep, 2), np.repeat(k, rep, 2), v, np.exp(log_g), beta, state
    )
    y, s = delta.chunked_gated_delta(*f32(q, k, v, log_g, beta, state), chunk=chunk)
    np.testing.assert_allclose(np.array(y), want_y, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(s), want_s, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("vector", [False, True])
def test_decays_far_past_fp32s_range_stay_exact(vector):
    """Gates of e^-40 a step: over a chunk they decay far past what fp32 holds (e^-88), which
    a decay factored through any one position would overflow; pairs stay exact."""
    q, k, v, log_g, beta, state = inputs(vector=vector, seed=9, strongest=40.0)
    log_g[:, ::3] = -0.01  # and some steps that keep nearly everything
    rep = v.shape[2] // q.shape[2]
    want_y, want_s = recurrence64(
        np.repeat(q, rep, 2), np.repeat(k, rep, 2), v, np.exp(log_g), beta, state
    )
    y, s = delta.chunked_gated_delta(*f32(q, k, v, log_g, beta, state))
    assert np.isfinite(np.array(y)).all()
    np.testing.assert_allclose(np.array(y), want_y, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(s), want_s, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("vector", [False, True])
def test_values_and_gradients_match_mlx_lms_loop(vector):
    q, k, v, log_g, beta, state = f32(*inputs(T=45, vector=vector, seed=1))
    rng = np.random.default_rng(2)
    wy, ws = f32(rng.standard_normal((2, 45, 2, 6)), rng.standard_normal((2, 2, 6, 8)))

    def loss(fn):
        def f(q, k, v, log_g, beta, state):
            y, s = fn(q, k, v, log_g, beta, state)
            return (y * wy).sum() + (s * ws).sum()

        return mx.value_and_grad(f, argnums=tuple(range(6)))

    def ours(q, k, v, log_g, beta, state):
        return delta.chunked_gated_delta(q, k, v, log_g, beta, state, chunk=8)

    def theirs(q, k, v, log_g, beta, state):
        return mlx_lm_delta.gated_delta_ops(q, k, v, mx.exp(log_g), beta, state)

    (a, ga), (b, gb) = (loss(fn)(q, k, v, log_g, beta, state) for fn in (ours, theirs))
    assert abs(a.item() - b.item()) <= 1e-4 * abs(b.item())
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=5e-5, rtol=1e-3)


@pytest.mark.parametrize("vector", [False, True])
def test_packed_examples_restart_the_state_values_and_gradients(vector):
    """Three examples in one row (across chunk boundaries, chunk 8): each position's output
    and every gradient equal each example's run alone from a zero state."""
    lengths = [5, 13, 11]
    T = sum(lengths)
    q, k, v, log_g, beta, _ = f32(*inputs(B=1, T=T, vector=vector, seed=3))
    ids = mx.array([sum(([i + 1] * n for i, n in enumerate(lengths)), [])])
    w = mx.array(np.random.default_rng(4).standard_normal((1, T, 2, 6)).astype(np.float32))

    def packed(*xs):
        y, _ = delta.chunked_gated_delta(*xs, segment_ids=ids, chunk=8)
        return (y * w).sum()

    def alone(*xs):
        total, start = 0.0, 0
        for n in lengths:
            part = [x[:, start : start + n] for x in xs]
            y, _ = delta.chunked_gated_delta(*part, chunk=8)
            total = total + (y * w[:, start : start + n]).sum()
            start += n
        return total

    args = (q, k, v, log_g, beta)
    (a, ga), (b, gb) = (
        mx.value_and_grad(fn, argnums=tuple(range(5)))(*args) for fn in (packed, alone)
    )
    assert abs(a.item() - b.item()) <= 1e-5 * max(abs(b.item()), 1)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "options",
    [{}, {"lower_bound": -5.0}, {"allow_neg_eigval": True}, {"mask": True}],
    ids=["plain", "lower-bound", "negative-eigenvalues", "padding-mask"],
)
def test_gated_delta_update_matches_mlx_lms(options):
    rng = np.random.default_rng(5)
    B, T, Hk, Hv, Dk, Dv = 2, 21, 2, 4, 8, 8
    q, k = f32(rng.standard_normal((B, T, Hk, Dk)), rng.standard_normal((B, T, Hk, Dk)))
    q, k = mlx_lm_delta.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v, a, b = f32(
        rng.standard_normal((B, T, Hv, Dv)),
        rng.standard_normal((B, T, Hv)),
        rng.standard_normal((B, T, Hv)),
    )
    A_log, dt_bias = f32(np.log(rng.uniform(1, 16, Hv)), np.ones(Hv))
    kw = dict(options)
    if kw.pop("mask", False):
        kw["mask"] = mx.array(np.arange(T)[None, :] < np.array([[T], [T - 6]]))
    y, s = delta.gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, **kw)
    want_y, want_s = mlx_lm_delta.gated_delta_update(
        q, k, v, a, b, A_log, dt_bias, None, use_kernel=False, **kw
    )
    if "mask" in kw:  # mlx-lm's kernel gives zeros where masked, its loop the state's reading
        want_y = mx.where(kw["mask"][..., None, None], want_y, 0)
    np.testing.assert_allclose(np.array(y), np.array(want_y), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(s), np.array(want_s), atol=2e-5, rtol=1e-4)


def test_log_gates_stay_finite_where_the_gate_underflows():
    A_log, a, dt = f32(np.log([16.0]), [[[60.0]]], [1.0])
    assert mlx_lm_delta.compute_g(A_log, a, dt).item() == 0.0
    assert delta.log_gates(A_log, a, dt).item() == pytest.approx(-16 * 61.0, rel=1e-5)


def test_the_segmented_convolution_keeps_examples_apart():
    rng = np.random.default_rng(6)
    C, K, lengths = 5, 4, [3, 6, 2]
    T = sum(lengths)
    conv = nn.Conv1d(C, C, K, groups=C, bias=False)
    x = mx.array(rng.standard_normal((1, T, C)).astype(np.float32))
    ids = mx.array([sum(([i + 1] * n for i, n in enumerate(lengths)), [])])
    got = delta.segmented_causal_conv(mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)]), conv.weight, ids)
    start, want = 0, []
    for n in lengths:  # each example after K - 1 zeros, as the layer starts a row
        want.append(conv(mx.pad(x[:, start : start + n], [(0, 0), (K - 1, 0), (0, 0)])))
        start += n
    np.testing.assert_allclose(np.array(got), np.array(mx.concatenate(want, 1)), atol=1e-6)


@pytest.fixture(
    scope="module", params=["qwen3_next", "qwen3_5", "kimi_linear", "olmo_hybrid", "bailing_moe_v3"]
)
def hybrid(request):
    from mlx_lm_archs import tiny_config

    from mlxtune.models import family_classes
    from mlxtune.models.configs import normalise_config

    mx.random.seed(3)
    config = tiny_config(request.param, 64)
    model_class, args_class = family_classes(config)
    return model_class(args_class.from_dict(normalise_config(config, args_class)))


def trains_as_mlx_lm(model, routed: str = "gated_delta_update"):
    """The training forward and its gradients with the model's recurrence routed equal mlx-lm's
    own; ``kernels.delta.<routed>`` is called, on the whole row."""
    from mlx.utils import tree_flatten

    tokens = mx.array(np.random.default_rng(7).integers(1, 64, (2, 70)))
    model.train()

    def loss(model):
        return model(tokens).astype(mx.float32).square().mean()

    calls = []
    update = getattr(delta, routed)

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return update(*a, **kw)

    want, want_g = nn.value_and_grad(model, loss)(model)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(delta, routed, counted)
        with kernel_attention(model, "reference"):
            got, got_g = nn.value_and_grad(model, loss)(model)
    assert calls and all(s[1] == 70 for s in calls)
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    a, b = dict(tree_flatten(got_g)), dict(tree_flatten(want_g))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(np.array(a[name]), np.array(b[name]), atol=1e-5, rtol=2e-3)


def packs_as_alone(model):
    """Two examples packed in a row give what each gives alone; without the restart the second
    reads the first's state."""
    rng = np.random.default_rng(8)
    a, b = rng.integers(1, 64, 40).tolist(), rng.integers(1, 64, 29).tolist()
    model.eval()
    with kernel_attention(model, "reference"):
        with segments(mx.array([[1] * len(a) + [2] * len(b)])):
            packed = model(mx.array([a + b]))
        alone = mx.concatenate([model(mx.array([a])), model(mx.array([b]))], axis=1)
    np.testing.assert_allclose(np.array(packed), np.array(alone), atol=2e-4, rtol=1e-3)
    with kernel_attention(model, "reference"):
        run_on = model(mx.array([a + b]))
    assert np.abs(np.array(run_on) - np.array(alone))[:, len(a) :].max() > 1e-3


def test_a_hybrid_trains_through_the_chunked_rule_as_through_mlx_lms_loop(hybrid):
    """mlx-lm's own training forward is the loop of one step a position."""
    trains_as_mlx_lm(hybrid)


def test_packed_examples_in_a_hybrid_give_what_each_gives_alone(hybrid):
    packs_as_alone(hybrid)


def test_the_memory_plan_counts_a_hybrids_delta_layers():
    from mlx_lm_archs import tiny_config

    from mlxtune.models import family_classes
    from mlxtune.models.capabilities import delta_layout
    from mlxtune.models.configs import normalise_config

    for name, vector in (("qwen3_next", False), ("kimi_linear", True)):
        config = normalise_config(tiny_config(name, 64), family_classes(tiny_config(name, 64))[1])
        model_class, args_class = family_classes(config)
        model = model_class(args_class.from_dict(config))
        # the layers that are not full attention, as the config lays them out
        if name == "qwen3_next":
            every = config["full_attention_interval"]
            want = sum((i + 1) % every != 0 for i in range(config["num_hidden_layers"]))
            hv, dk, dv = (config[f"linear_{x}"] for x in ("num_value_heads", "key_head_dim",
                                                          "value_head_dim"))  # fmt: skip
        else:
            lac = config["linear_attn_config"]
            want = len(lac["kda_layers"])
            hv, dk = lac["num_heads"], lac["head_dim"]
            dv = dk
        got = delta_layout(model, config)
        assert got["delta_layers"] == want, (name, got)
        assert got["delta_token"] == delta.saved_per_token(hv, dk, dv, vector), name
    llama = family_classes(tiny_config("llama", 64))
    plain = llama[0](llama[1].from_dict(normalise_config(tiny_config("llama", 64), llama[1])))
    assert delta_layout(plain, tiny_config("llama", 64)) == {}
