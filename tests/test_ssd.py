"""The linear recurrences without the delta correction, chunkwise (kernels/delta.py with
``delta=False``): Mamba-2's SSD (``ssd_update``) against a NumPy float64 recurrence and mlx-lm's
own ``ssm_attn``, Bailing's linear attention against mlx-lm's ``recurrent_gla``, values and
gradients; packed examples restarting the state as if each ran alone; and the families that
call them (Nemotron-H, Falcon-H1, Granite 4, Mamba-2, Bailing-linear) routed while training and
packing, with LFM2's short convolutions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.bailing_moe_linear import recurrent_gla
from mlx_lm.models.ssm import ssm_attn
from test_gated_delta import packs_as_alone, trains_as_mlx_lm

from mlxtune.kernels import delta
from mlxtune.models import kernel_attention, lm_parts, packing_refusal
from mlxtune.models.context import segments
from mlxtune.models.patches import RECURRENCES

LIMIT = (0.001, 100.0)


def ssd64(x, A_log, B, C, D, dt, dt_bias, state, limit=LIMIT):
    """The SSD one position at a time in float64: S = exp(dt A) S + dt x B^T, y = S C + D x."""
    b_, t_, h_, _ = x.shape
    g_ = B.shape[2]
    step = np.logaddexp(0.0, dt + dt_bias)  # softplus
    step = np.clip(step, *limit)
    A = -np.exp(A_log)
    s = state.copy()
    y = np.zeros(x.shape)
    for b in range(b_):
        for h in range(h_):
            g = h // (h_ // g_)
            S = s[b, h]
            for t in range(t_):
                S = np.exp(step[b, t, h] * A[h]) * S + step[b, t, h] * np.outer(
                    x[b, t, h], B[b, t, g]
                )
                y[b, t, h] = S @ C[b, t, g] + D[h] * x[b, t, h]
            s[b, h] = S
    return y, s


def inputs(b=2, t=45, h=4, dh=6, g=2, n=8, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((b, t, h, dh)),
        0.5 * rng.standard_normal(h),  # A_log
        0.5 * rng.standard_normal((b, t, g, n)),  # B
        0.5 * rng.standard_normal((b, t, g, n)),  # C
        rng.standard_normal(h),  # D
        rng.standard_normal((b, t, h)),  # dt, before its softplus
        0.1 * rng.standard_normal(h),  # dt_bias
        0.3 * rng.standard_normal((b, h, dh, n)),  # state
    )


def f32(*xs):
    return [mx.array(np.asarray(x, np.float32)) for x in xs]


@pytest.mark.parametrize("t", [1, 45, 130])
@pytest.mark.parametrize("start", ["zeros", "state"])
def test_values_match_a_float64_recurrence(t, start):
    args = inputs(t=t, seed=t)
    if start == "zeros":
        args = (*args[:-1], np.zeros_like(args[-1]))
    want_y, want_s = ssd64(*args)
    got_y, got_s = delta.ssd_update(
        *f32(*args[:-1]), None if start == "zeros" else f32(args[-1])[0]
    )
    np.testing.assert_allclose(np.array(got_y), want_y, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(got_s), want_s, atol=2e-5, rtol=1e-4)


def test_small_chunks_match_the_recurrence_too():
    """The chunk boundaries are where the state is carried: chunks of 4 over 45 positions."""
    x, A_log, B, C, D, dt, dt_bias, state = inputs(seed=5)
    want_y, want_s = ssd64(x, A_log, B, C, D, dt, dt_bias, state)
    step = np.clip(np.logaddexp(0.0, dt + dt_bias), *LIMIT)
    log_g = step * -np.exp(A_log)
    y, s = delta.chunked_gated_delta(*f32(C, B, x, log_g, step, state), chunk=4, delta=False)
    np.testing.assert_allclose(np.array(y) + x * D[:, None], want_y, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(s), want_s, atol=2e-5, rtol=1e-4)


def test_values_and_gradients_match_mlx_lms_ssd():
    """Against mlx-lm's ``ssm_attn`` over 300 positions (past its own 256-position steps),
    from a carried state: y, the state after, and every input's gradient."""
    args = f32(*inputs(t=300, seed=2))
    rng = np.random.default_rng(3)
    wy, ws = f32(rng.standard_normal((2, 300, 4, 6)), rng.standard_normal((2, 4, 6, 8)))

    def loss(fn):
        def f(x, A_log, B, C, D, dt, dt_bias, state):
            y, s = fn(x, A_log, B, C, D, dt, dt_bias, state, LIMIT)
            return (y * wy).sum() + (s * ws).sum()

        return mx.value_and_grad(f, argnums=tuple(range(8)))

    (a, ga), (b, gb) = (loss(fn)(*args) for fn in (delta.ssd_update, ssm_attn))
    assert abs(a.item() - b.item()) <= 1e-4 * abs(b.item())
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4, rtol=1e-3)


def test_packed_examples_restart_the_state_values_and_gradients():
    """Three examples in one row across chunk boundaries: each position's output and every
    gradient equal each example's run alone from a zero state."""
    lengths = [50, 70, 33]
    t = sum(lengths)
    x, A_log, B, C, D, dt, dt_bias, _ = f32(*inputs(b=1, t=t, seed=4))
    ids = mx.array([sum(([i + 1] * n for i, n in enumerate(lengths)), [])])
    w = mx.array(np.random.default_rng(6).standard_normal((1, t, 4, 6)).astype(np.float32))

    def packed(x, B, C, dt, A_log):
        y, _ = delta.ssd_update(x, A_log, B, C, D, dt, dt_bias, segment_ids=ids)
        return (y * w).sum()

    def alone(x, B, C, dt, A_log):
        total, start = 0.0, 0
        for n in lengths:
            part = [v[:, start : start + n] for v in (x, B, C, dt)]
            y, _ = delta.ssd_update(part[0], A_log, part[1], part[2], D, part[3], dt_bias)
            total = total + (y * w[:, start : start + n]).sum()
            start += n
        return total

    args = (x, B, C, dt, A_log)
    (a, ga), (b, gb) = (
        mx.value_and_grad(fn, argnums=tuple(range(5)))(*args) for fn in (packed, alone)
    )
    assert abs(a.item() - b.item()) <= 1e-5 * max(abs(b.item()), 1)
    for p, q in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.array(p), np.array(q), atol=5e-5, rtol=1e-4)


def test_a_padding_mask_keeps_the_state_where_it_is_false():
    """Left padding (batched rows of different lengths): the state after the row equals the
    state of the valid positions alone, as mlx-lm's own masked SSD gives."""
    x, A_log, B, C, D, dt, dt_bias, _ = f32(*inputs(b=1, t=40, seed=7))
    mask = mx.array([[False] * 9 + [True] * 31])
    _, got = delta.ssd_update(x, A_log, B, C, D, dt, dt_bias, None, LIMIT, mask)
    _, want = delta.ssd_update(x[:, 9:], A_log, B[:, 9:], C[:, 9:], D, dt[:, 9:], dt_bias)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-4)
    _, theirs = ssm_attn(x, A_log, B, C, D, dt, dt_bias, None, LIMIT, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(theirs), atol=1e-5, rtol=1e-4)


def test_bailings_linear_attention_matches_mlx_lms_values_and_gradients():
    """``recurrent_gla`` routed (q, k, v [B, H, T, D], a fixed decay a head, a scale, a carried
    state [B, H, Dk, Dv]) against mlx-lm's loop: y, the state, every gradient."""
    rng = np.random.default_rng(9)
    q, k, v = f32(*(rng.standard_normal((2, 3, 90, 8)) for _ in range(3)))
    g, h0 = f32(-rng.uniform(0.01, 0.5, 3), 0.3 * rng.standard_normal((2, 3, 8, 8)))
    wy, ws = f32(rng.standard_normal((2, 3, 90, 8)), rng.standard_normal((2, 3, 8, 8)))
    chunked = RECURRENCES["recurrent_gla"](recurrent_gla)

    def loss(fn):
        def f(q, k, v, g, h0):
            y, s = fn(q, k, v, g, 0.35, h0)
            return (y * wy).sum() + (s * ws).sum()

        return mx.value_and_grad(f, argnums=tuple(range(5)))

    (a, ga), (b, gb) = (loss(fn)(q, k, v, g, h0) for fn in (chunked, recurrent_gla))
    assert abs(a.item() - b.item()) <= 1e-4 * abs(b.item())
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4, rtol=1e-3)


def test_bailing_hybrids_masked_linear_attention_matches_mlx_lms():
    """Bailing-hybrid's ``recurrent_gla`` (keyword arguments, a padding mask): y at the valid
    positions and the state after, routed, equal mlx-lm's own chunked form."""
    from mlx_lm.models.bailing_hybrid import recurrent_gla as hybrid_gla

    rng = np.random.default_rng(11)
    q, k, v = f32(*(rng.standard_normal((2, 3, 70, 8)) for _ in range(3)))
    g = f32(-rng.uniform(0.01, 0.5, 3))[0]
    mask = mx.array(np.arange(70)[None] >= np.array([[0], [12]]))  # the second row left-padded
    chunked = RECURRENCES["recurrent_gla"](hybrid_gla)
    (y, s), (want_y, want_s) = (
        fn(q, k, v, g, scale=0.35, h=None, mask=mask) for fn in (chunked, hybrid_gla)
    )
    np.testing.assert_allclose(np.array(y), np.array(want_y), atol=1e-4, rtol=1e-3)
    np.testing.assert_allclose(np.array(s), np.array(want_s), atol=1e-4, rtol=1e-3)


SSD_FAMILIES = [
    "mamba2",
    "nemotron_h",
    "falcon_h1",
    "granitemoehybrid",
    "bailing_moe_linear",
    "bailing_hybrid",
]


@pytest.fixture(scope="module", params=SSD_FAMILIES)
def family(request):
    from mlx_lm_archs import tiny_config

    from mlxtune.models import family_classes
    from mlxtune.models.configs import normalise_config

    mx.random.seed(3)
    config = tiny_config(request.param, 64)
    model_class, args_class = family_classes(config)
    return model_class(args_class.from_dict(normalise_config(config, args_class)))


def test_a_family_trains_through_the_chunked_form_as_through_mlx_lms(family):
    trains_as_mlx_lm(family, "chunked_gated_delta")


def test_packed_examples_in_a_family_give_what_each_gives_alone(family):
    packs_as_alone(family)
    assert packing_refusal(family, lm_parts(family)) is None


def test_a_family_whose_attention_is_its_own_is_refused_for_that():
    """PLaMo 2's SSD restarts, but its attention calls MLX directly: packing is refused for the
    attention, not for the state."""
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model

    model, _ = build_model(tiny_config("plamo2", 64), 64, seed=1)
    why = packing_refusal(model, lm_parts(model))
    assert why is not None and "carry state" not in why and "attention" in why


def test_lfm2s_short_convolutions_keep_packed_examples_apart():
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model

    model, _ = build_model(tiny_config("lfm2", 64), 64, seed=1)
    rng = np.random.default_rng(10)
    a, b = rng.integers(1, 64, 23).tolist(), rng.integers(1, 64, 17).tolist()
    with kernel_attention(model, "reference"):
        with segments(mx.array([[1] * len(a) + [2] * len(b)])):
            packed = model(mx.array([a + b]))
        run_on = model(mx.array([a + b]))
    alone = mx.concatenate([model(mx.array([a])), model(mx.array([b]))], axis=1)
    np.testing.assert_allclose(np.array(packed), np.array(alone), atol=2e-4, rtol=1e-3)
    assert np.abs(np.array(run_on) - np.array(alone))[:, len(a) :].max() > 1e-3
    assert packing_refusal(model, lm_parts(model)) is None


@pytest.mark.parametrize("name", ["mamba", "jamba", "rwkv7"])
def test_a_per_token_recurrence_mlxtune_does_not_restart_is_refused_for_its_state(name):
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model

    model, _ = build_model(tiny_config(name, 64), 64, seed=1)
    assert "carry state along the sequence" in packing_refusal(model, lm_parts(model))


def test_the_memory_plan_counts_ssd_layers():
    from mlx_lm_archs import tiny_config

    from mlxtune.models import build_model
    from mlxtune.models.capabilities import delta_layout

    config = tiny_config("nemotron_h", 64)
    model, _ = build_model(config, 64, seed=1)
    pattern = config["hybrid_override_pattern"]
    heads, dh, n = (config[k] for k in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size"))
    got = delta_layout(model, config)
    assert got["delta_layers"] == pattern.count("M"), (pattern, got)
    assert got["delta_token"] == delta.saved_per_token(heads, n, dh, delta=False)
