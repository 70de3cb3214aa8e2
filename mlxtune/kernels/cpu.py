"""Exponentials for MLX's CPU backend: softmax, SwiGLU and short-row attention built on an `exp`
that ``mx.compile`` fuses into vector code.

On the CPU, MLX's ``exp`` (and with it ``softmax``, ``sigmoid`` and SiLU) runs one element at a
time, at about 60-70M elements/s on an x86 core. That bounds a CPU training step: the attention
probabilities and the MLP's gate pay it in every layer. Here ``exp`` is written in plain
arithmetic that a compiled graph fuses: Cody-Waite range reduction, ``x = n ln2 + r`` with
``|r| <= ln2/2``, a degree-5 polynomial for ``e^r`` fitted to relative error, and ``2^n`` built
from its exponent bits. Its relative error is under 1e-6 (fp32 keeps 6e-8), and compiled it runs
5-7x faster than ``mx.exp``.

Each function has its own VJP: softmax's works from its output and adds no exponentials;
SwiGLU's recomputes one sigmoid; attention's recomputes the probabilities, as MLX's fused
attention does, so that one layer's scores at a time are alive. Inputs of any float dtype are
computed in fp32 and returned in their own dtype.

The attention here covers the rows that the chunked tier gives to MLX's fused attention (at most
``flash.FUSED_SCORES`` score elements). Under causal masking it splits the queries into blocks and
gives each block only the keys up to its end, so the probabilities above the diagonal are mostly
never computed: with 4 blocks, 62% of the full scores.

The chunked tier's cross-entropy and attention tiles take their exponentials from here too
(``exp_of_nonpositive``, ``logsumexp``, and ``tanh`` for a soft-capped loss): every one of them
has an argument <= 0. On a GPU those
fall back to MLX's own, and the trainer uses the rest only on the CPU (``flash.attention_chunked``
for short rows, ``models.kernel_attention`` for SwiGLU): MLX's GPU kernels are faster there.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

_LOG2E = 1.4426950408889634
# ln 2 in two parts: n * _LN2_HI is exact in fp32 for |n| <= 2^11, so x - n ln2 loses nothing
_LN2_HI = 0.693145751953125
_LN2_LO = 1.428606765330187e-06
# Adding and taking away 1.5 * 2^23 rounds an fp32 of magnitude under 2^22 to an integer.
_ROUND = 12582912.0
# Inputs are clipped to [_LOWEST, _HIGHEST]. At _LOWEST, n = -127, whose exponent bits are those
# of 0.0, so e^x is 0 below about -87.7 (fp32's normal range ends at e^-87.3); above _HIGHEST
# 2^n would overflow its exponent bits.
_LOWEST = -88.0
_HIGHEST = 88.0


def _fit_coefficients(degree: int = 5) -> tuple[float, ...]:
    """Polynomial coefficients for e^r on [-ln2/2, ln2/2], fitted to relative error on Chebyshev
    nodes (close to minimax: under 1e-7 at degree 5), the constant held at 1 so that e^0 = 1."""
    k = np.arange(2048)
    half = math.log(2) / 2
    r = half * np.cos(np.pi * (k + 0.5) / k.size)
    basis = np.vander(r, degree + 1, increasing=True)[:, 1:] / np.exp(r)[:, None]
    coef = np.linalg.lstsq(basis, 1 - np.exp(-r), rcond=None)[0]
    return (1.0, *(float(c) for c in coef))


_C = _fit_coefficients()


def exp_nonpositive(x: mx.array) -> mx.array:
    """e^x for x <= 0, as fusible fp32 arithmetic, in x's dtype (fp32 for integer x). Below about
    -87.7 (fp32's normal range ends at e^-87.3) the result is 0, as a flushed subnormal would be,
    so e^-inf = 0; inputs above 0 are clipped to 88 (2^n's exponent bits stay in range, for
    callers whose inputs are 0 up to rounding). NaN stays NaN.

    Two passes when compiled: one builds 2^n from its exponent bits (a bit view ends a fused
    kernel), the other the polynomial times 2^n. A single pass with two outputs would be slower
    on MLX's CPU backend. The result is materialized (its kernel ends here): a fused kernel that
    went on to use it ran several times slower than the exponential itself (a sigmoid over 1.2M
    elements took 10.8 ms that way, 2.0 ms with this break; SwiGLU 10.1 and 2.1 ms)."""
    if x.dtype != mx.float32:
        out = exp_nonpositive(x.astype(mx.float32))
        return out.astype(x.dtype) if mx.issubdtype(x.dtype, mx.floating) else out
    x = mx.clip(x, _LOWEST, _HIGHEST)
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = (x - n * _LN2_HI) - n * _LN2_LO
    r2 = r * r
    c0, c1, c2, c3, c4, c5 = _C
    p = (c0 + r * c1) + r2 * ((c2 + r * c3) + r2 * (c4 + r * c5))
    two_n = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)
    return materialized(p * two_n)


def on_cpu() -> bool:
    """Whether MLX's default device is the CPU, where this module's forms are the faster ones."""
    return mx.default_device() == mx.cpu


def exp_of_nonpositive(x: mx.array) -> mx.array:
    """e^x for x <= 0: exp_nonpositive on the CPU, mx.exp elsewhere."""
    return exp_nonpositive(x) if on_cpu() else mx.exp(x)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(e^x)) over the last axis of fp32 x with finite entries: mx.logsumexp, with
    exp_nonpositive on the CPU. No gradient of its own: for the forward of functions that have
    their own VJP."""
    if not on_cpu():
        return mx.logsumexp(x, axis=-1)
    m = x.max(axis=-1, keepdims=True)
    m = mx.where(m == -mx.inf, 0.0, m)  # a row of -inf gives -inf, not NaN
    return (m + mx.log(exp_nonpositive(materialized(x - m)).sum(axis=-1, keepdims=True)))[..., 0]


def tanh(x: mx.array) -> mx.array:
    """tanh(x) from e^-2|x| (exp_nonpositive) on the CPU, mx.tanh elsewhere; fp32 inside, in x's
    dtype. Within 2e-7 absolute (not relative: near 0, 1 - e^-2|x| cancels), which suits a soft
    cap. No gradient of its own (the chunked loss writes its own)."""
    if not on_cpu():
        return mx.tanh(x)
    xf = x.astype(mx.float32)
    e = exp_nonpositive(-2.0 * mx.abs(xf))
    return (mx.where(xf < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)).astype(x.dtype)


def materialized(x: mx.array) -> mx.array:
    """x, ending the fused kernel that computes it (a reshape is not fused, and costs nothing on
        a contiguous array). The kernels after it then read a plain contiguous input instead of a
        broadcast one, which MLX's CPU kernels index element by element (an exp over 4M elements
    took 17 ms reading a broadcast row maximum and 8 ms reading a materialized difference)."""
    return x.reshape(-1).reshape(x.shape)


@mx.custom_function
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (fp32 inside), with exp_nonpositive."""
    xf = x.astype(mx.float32)
    shifted = materialized(xf - xf.max(axis=-1, keepdims=True))
    e = exp_nonpositive(shifted)
    return (e / e.sum(axis=-1, keepdims=True)).astype(x.dtype)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    p = output.astype(mx.float32)
    g = cotangent.astype(mx.float32)
    return (p * (g - (p * g).sum(axis=-1, keepdims=True))).astype(primals[0].dtype)


def _sigmoid(x: mx.array) -> mx.array:
    """sigmoid(x) for fp32 x, from e^-|x| (never overflows)."""
    e = exp_nonpositive(-mx.abs(x))
    return mx.where(x >= 0, 1.0, e) / (1.0 + e)


@mx.custom_function
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, as mlx-lm's models compute their MLP (fp32 inside)."""
    g = gate.astype(mx.float32)
    out = up.dtype if gate.dtype == up.dtype else mx.float32  # as MLX promotes mixed halves
    return (g * _sigmoid(g) * up.astype(mx.float32)).astype(out)


@swiglu.vjp
def _swiglu_vjp(primals, cotangent, output):
    gate, up = primals
    g, u = gate.astype(mx.float32), up.astype(mx.float32)
    c = cotangent.astype(mx.float32)
    s = _sigmoid(g)
    d_gate = c * u * s * (1.0 + g * (1.0 - s))
    d_up = c * g * s
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


# Query blocks of the causal attention: at most this many, of at least MIN_BLOCK rows each
# (at T=256, 4 blocks ran 1.6x faster than MLX's fused attention and 8 no faster than 4).
BLOCKS = 4
MIN_BLOCK = 32
_MASKED = -1e30


def _blocks(t: int, causal: bool) -> list[tuple[int, int, int]]:
    """(first query, end of queries, end of keys) of each query block."""
    if not causal:
        return [(0, t, t)]
    n = max(1, min(BLOCKS, t // MIN_BLOCK))
    size = -(-t // n)
    # keys past a block's last query are all masked for it
    return [(q0, min(q0 + size, t), min(q0 + size, t)) for q0 in range(0, t, size)]


def attention(q, k, v, scale, causal=True, segment_ids=None):
    """softmax(q k^T * scale + mask) v with this module's softmax, for rows short enough to build
    their scores (shapes as ``flash.attention_reference``). The backward recomputes the
    probabilities block by block rather than keeping them, so, like MLX's fused attention, only
    one layer's scores are alive at a time."""
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    blocks = _blocks(t, causal)

    def probabilities(qs, kf, q0, q1, k1):
        """[B, Hkv, G, q1-q0, k1] of the scaled, grouped queries qs."""
        allowed = None
        if causal:
            allowed = mx.arange(k1)[None, :] <= mx.arange(q0, q1)[:, None]
        if segment_ids is not None:
            same = (segment_ids[:, q0:q1, None] == segment_ids[:, None, :k1])[:, None, None]
            allowed = same if allowed is None else allowed & same
        s = qs[..., q0:q1, :] @ kf[..., :k1, :].swapaxes(-1, -2)
        return softmax(s if allowed is None else mx.where(allowed, s, _MASKED))

    def grouped(x):  # [B, H, T, D] -> fp32 [B, Hkv, G, T, D]: the query heads sharing a k/v head
        return x.astype(mx.float32).reshape(b, hkv, x.shape[1] // hkv, t, d)

    @mx.custom_function
    def attn(q, k, v):
        qs, kf, vf = grouped(q) * scale, grouped(k), grouped(v)
        outs = [probabilities(qs, kf, q0, q1, k1) @ vf[..., :k1, :] for q0, q1, k1 in blocks]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-2)
        return out.reshape(q.shape).astype(q.dtype)

    @attn.vjp
    def attn_vjp(primals, cotangent, output):
        # from inputs that wait for the cotangent: else a compiled step merges the probabilities
        # recomputed here with the forward's identical ones, and keeps every layer's
        q, k, v = mx.depends(list(primals), [cotangent])
        qs, kf, vf = grouped(q) * scale, grouped(k), grouped(v)
        go = grouped(cotangent)
        delta = (go * grouped(output)).sum(axis=-1, keepdims=True)  # rowsum(dO * O)
        dqs, dk, dv = [], None, None

        def full(x, k1):  # [B, Hkv, k1, D] keys' gradients, padded with zeros to T keys
            return x if k1 == t else mx.pad(x, [(0, 0), (0, 0), (0, t - k1), (0, 0)])

        for q0, q1, k1 in blocks:
            p = probabilities(qs, kf, q0, q1, k1)
            gb = go[..., q0:q1, :]
            ds = p * (gb @ vf[..., :k1, :].swapaxes(-1, -2) - delta[..., q0:q1, :])
            dqs.append(ds @ kf[..., :k1, :])
            dk_b = full((ds.swapaxes(-1, -2) @ qs[..., q0:q1, :]).sum(axis=2), k1)
            dv_b = full((p.swapaxes(-1, -2) @ gb).sum(axis=2), k1)
            dk = dk_b if dk is None else dk + dk_b
            dv = dv_b if dv is None else dv + dv_b
        dq = (dqs[0] if len(dqs) == 1 else mx.concatenate(dqs, axis=-2)) * scale
        return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return attn(q, k, v)
