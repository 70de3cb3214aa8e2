"""What each kernel computes, in NumPy float64: the references for checking one kernel alone
(the CPU emulator in the tests, CuPy or MLX on a GPU in bench/device/). Arguments follow the
kernels' inputs (see the ``.body`` files); these build the full [T, T] scores, so keep sizes
small."""

from __future__ import annotations

import numpy as np

MASKED = -1e30


def lce_forward(z, tl, st, softcap=None):
    """The state [N, 4] (max, sum of exp, target logit, sum of logits) after folding in ``z``."""
    x = np.asarray(z, np.float64)
    if softcap is not None:
        x = softcap * np.tanh(x / softcap)
    n, c = x.shape
    m = x.max(axis=1)
    s = np.exp(x - m[:, None]).sum(axis=1)
    inside = (tl >= 0) & (tl < c)
    tgt = np.where(inside, x[np.arange(n), np.clip(tl, 0, c - 1)], 0.0)
    m0, s0 = st[:, 0].astype(np.float64), st[:, 1].astype(np.float64)
    mm = np.maximum(m0, m)
    return np.stack(
        [mm, s0 * np.exp(m0 - mm) + s * np.exp(m - mm), st[:, 2] + tgt, st[:, 3] + x.sum(axis=1)],
        axis=1,
    )


def lce_backward(z, tl, lse, g, softcap, one_minus_eps, eps_over_v):
    """d loss / d z [N, C]."""
    x = np.asarray(z, np.float64)
    y = np.tanh(x / softcap) if softcap is not None else None
    if softcap is not None:
        x = softcap * y
    n, c = x.shape
    d = np.exp(x - lse[:, None]) - eps_over_v
    d -= one_minus_eps * (np.arange(c)[None, :] == tl[:, None])
    d *= g[:, None]
    if softcap is not None:
        d *= 1.0 - y * y
    return d


def _mask(t, causal, seg):
    """[B or 1, 1, T, T] True where query i may see key j."""
    ok = np.ones((1, 1, t, t), dtype=bool)
    if causal:
        ok = ok & np.tril(np.ones((t, t), dtype=bool))[None, None]
    if seg is not None:
        ok = ok & (seg[:, None, :, None] == seg[:, None, None, :])
    return ok


def _expand(k, hq):
    return np.repeat(np.asarray(k, np.float64), hq // k.shape[1], axis=1)


def attn_forward(q, k, v, scale, causal=True, seg=None):
    """(o [B, HQ, T, DH], lse [B, HQ, T])."""
    q = np.asarray(q, np.float64)
    hq, t = q.shape[1], q.shape[2]
    s = np.where(_mask(t, causal, seg), q @ _expand(k, hq).swapaxes(-1, -2) * scale, MASKED)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(axis=-1, keepdims=True)))[..., 0]
    return (p / p.sum(axis=-1, keepdims=True)) @ _expand(v, hq), lse


def attn_backward(q, k, v, dout, lse, dlt, scale, causal=True, seg=None):
    """(dq, dk, dv) from the saved lse and D = rowsum(dO * O), as the kernels compute them."""
    q, dout = np.asarray(q, np.float64), np.asarray(dout, np.float64)
    b, hq, t, dh = q.shape
    hkv = k.shape[1]
    ke, ve = _expand(k, hq), _expand(v, hq)
    ok = _mask(t, causal, seg)
    p = np.where(ok, np.exp(q @ ke.swapaxes(-1, -2) * scale - lse[..., None]), 0.0)
    ds = p * (dout @ ve.swapaxes(-1, -2) - dlt[..., None]) * scale
    dq = ds @ ke
    dk = (ds.swapaxes(-1, -2) @ q).reshape(b, hkv, hq // hkv, t, dh).sum(axis=2)
    dv = (p.swapaxes(-1, -2) @ dout).reshape(b, hkv, hq // hkv, t, dh).sum(axis=2)
    return dq, dk, dv
