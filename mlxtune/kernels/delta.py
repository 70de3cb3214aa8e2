"""The gated delta rule in its chunkwise parallel form, for training hybrid linear-attention
models (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi-Linear) in MLX operations, forward and backward.

The recurrence (one head; the state S is Dv x Dk, as mlx-lm keeps it):

    S_t = g_t * S_{t-1} + beta_t * (v_t - g_t * S_{t-1} k_t) k_t^T,    y_t = S_t q_t

with g_t a scalar a head (or one per key dimension: "vectorized" gates). mlx-lm trains it by
a loop of T steps, each a new state kept for the backward. Here a row is cut into chunks of C
positions. Within a chunk, with h the state entering it (S^T), Gamma_i the gates' product
from the chunk's start to i, and Delta_i = beta_i (v_i - S~_i k_i) what position i writes:

    Delta = (I + A)^{-1} (beta V - beta Gamma K h)           A_ij = beta_i (Gamma_i/Gamma_j) k_i.k_j, j < i
    Y     = (Gamma Q) h + ((Gamma_i/Gamma_j) q_i.k_j)_{j<=i} Delta
    h'    = Gamma_C h + sum_j (Gamma_C/Gamma_j) k_j Delta_j^T

(I + A) is unit lower triangular: its inverse is the product (I - A)(I + A^2)(I + A^4)...,
exact in log2 C factors since A^C = 0. Everything but the carry of h is one batched product
over all chunks; the carry is T/C steps of matmuls. Memory is O(T H D) and one state a chunk.

Packed rows (``segment_ids``) restart the state where an example starts: no position reads
what another example wrote, within a chunk (masked pairs) or across chunks (a carry only into
positions of the example the previous chunk ended in)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64
"""Positions a chunk holds (scalar gates)."""

VECTOR_CHUNK = 16
"""Positions a chunk holds with a gate per key dimension: its pairs' decays are taken one key
dimension at a time, exp(G_i - G_j) for j <= i ([C, C, Dk] a chunk), so that no decay however
strong overflows or underflows a factor (a factored exp(G_i - G_m) exp(G_m - G_j) would)."""


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^{-1} for strictly lower triangular ``a`` [..., C, C]: the product
    (I - a)(I + a^2)(I + a^4)... up to a^(C/2), exact since a^C = 0."""
    c = a.shape[-1]
    p = -a
    r = mx.eye(c, dtype=a.dtype) + p
    span = 2
    while span < c:
        p = p @ p
        r = r + r @ p
        span *= 2
    return r


def _chunks(x: mx.array, c: int) -> mx.array:
    """[B, T, H, ...] with T a multiple of c -> [B, H, N, c, ...]."""
    b, t, h = x.shape[:3]
    x = x.reshape(b, t // c, c, h, *x.shape[3:])
    return mx.moveaxis(x, 3, 1)


def _unchunk(x: mx.array) -> mx.array:
    """[B, H, N, c, D] -> [B, T, H, D]."""
    b, h, n, c, d = x.shape
    return mx.moveaxis(x, 1, 3).reshape(b, n * c, h, d)


def _pair_products(qc, kc, G, pair, strict, vector):
    """Each chunk's q_i.k_j and k_i.k_j with the decay from j to i (pairs where ``pair`` and
    ``strict`` hold; zero elsewhere): [B, H, N, C, C] each; k.k is None where ``strict`` is
    (a rule without the delta correction needs only q.k)."""
    if vector:  # each pair's decay a key dimension at a time: [B, H, N, C, C, Dk]
        pairs = pair[..., None]
        diff = G[..., :, None, :] - G[..., None, :, :]
        decay = mx.where(pairs, mx.exp(mx.where(pairs, diff, 0.0)), 0.0) * kc[..., None, :, :]
        qk = (qc[..., :, None, :] * decay).sum(-1)
        if strict is None:
            return qk, None
        kk = mx.where(strict, (kc[..., :, None, :] * decay).sum(-1), 0.0)
    else:
        diff = G - mx.swapaxes(G, -1, -2)  # G_i - G_j [B, H, N, C, C]
        decay = mx.where(pair, mx.exp(mx.where(pair, diff, 0.0)), 0.0)
        qk = decay * (qc @ mx.swapaxes(kc, -1, -2))
        if strict is None:
            return qk, None
        kk = mx.where(strict, decay, 0.0) * (kc @ mx.swapaxes(kc, -1, -2))
    return qk, kk


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    segment_ids: mx.array | None = None,
    chunk: int | None = None,
    delta: bool = True,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a whole row, chunkwise: (y [B, T, Hv, Dv], the state after the
    row [B, Hv, Dv, Dk]). q, k: [B, T, Hk, Dk] (Hv a multiple of Hk), already normalised as
    the model does; v: [B, T, Hv, Dv]; log_g: the gates' logarithms, [B, T, Hv] or
    [B, T, Hv, Dk]; beta: [B, T, Hv]; state: [B, Hv, Dv, Dk] or None (zeros);
    segment_ids: [B, T] packed examples, the state restarting where the id changes. Computed
    in fp32; y in q's dtype, the state in fp32.

    ``delta=False``: the rule without the delta correction, S_t = g_t S_{t-1} + beta_t v_t k_t^T
    (Mamba-2's SSD, with q = C, k = B, v = x, beta = dt, log_g = dt A): no within-chunk
    inverse, and nothing the carried state takes back from a write."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    vector = log_g.ndim == 4
    c = chunk or (VECTOR_CHUNK if vector else CHUNK)
    out_dtype = q.dtype
    if Hv != Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    f32 = mx.float32
    q, k, v, log_g, beta = (x.astype(f32) for x in (q, k, v, log_g, beta))
    pad = -T % c
    if pad:  # zero keys and betas, unit gates: the padding writes nothing and keeps the state
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)  # noqa: E731
        q, k, v, log_g, beta = (mx.pad(x, widths(x)) for x in (q, k, v, log_g, beta))
        if segment_ids is not None:
            segment_ids = mx.pad(segment_ids, [(0, 0), (0, pad)], mode="edge")
    n = (T + pad) // c
    qc, kc, vc = _chunks(q, c), _chunks(k, c), _chunks(v, c)  # [B, H, N, C, D]
    bc = _chunks(beta[..., None], c)  # [B, H, N, C, 1]
    G = mx.cumsum(_chunks(log_g if vector else log_g[..., None], c), axis=3)  # [B, H, N, C, 1|Dk]

    pair, carry_in, carry_out = _segment_masks(segment_ids, B, n, c)
    strict = pair & ~mx.eye(c, dtype=mx.bool_) if delta else None

    qk, kk = _pair_products(qc, kc, G, pair, strict, vector)
    gamma = mx.exp(G)  # [B, H, N, C, 1|Dk]
    if delta:
        inverse = _unit_lower_inverse(bc * kk)
        u = inverse @ (bc * vc)  # [B, H, N, C, Dv]
        w = inverse @ (bc * gamma * kc if carry_in is None else bc * gamma * kc * carry_in)
    else:
        u = bc * vc
    q_carry = gamma * qc if carry_in is None else gamma * qc * carry_in
    last = G[..., -1:, :]  # [B, H, N, 1, 1|Dk]
    k_last = kc * mx.exp(last - G)
    if carry_out is not None:
        k_last = k_last * carry_out
    keep = mx.exp(last[..., 0, :])  # [B, H, N, 1|Dk]
    if carry_in is not None:
        keep = keep * carry_in[:, :, :, -1]

    h = (
        mx.zeros((B, Hv, Dk, Dv), dtype=f32)
        if state is None
        else mx.swapaxes(state.astype(f32), -1, -2)
    )
    keep = mx.broadcast_to(keep, (B, Hv, n, keep.shape[-1]))
    if delta:
        y, h = _carry(u, w, q_carry, qk, k_last, keep, h)
    else:
        y, h = _carry_plain(u, q_carry, qk, k_last, keep, h)
    y = _unchunk(y)[:, :T]
    return y.astype(out_dtype), mx.swapaxes(h, -1, -2)


def _segment_masks(segment_ids, b: int, n: int, c: int):
    """(the pairs j <= i a chunk reads, [C, C] or [B, 1, N, C, C]; the positions the carried
    state reaches, and those whose writes it carries on, [B, 1, N, C, 1] each or None): with
    packed ``segment_ids`` only pairs and carries within one example."""
    causal = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    if segment_ids is None:
        return causal, None, None
    sc = segment_ids.reshape(b, n, c)
    pair = ((sc[..., :, None] == sc[..., None, :]) & causal)[:, None]  # [B, 1, N, C, C]
    before = mx.concatenate([sc[:, :1, :1], sc[:, :-1, -1:]], axis=1)  # the last id before
    carry_in = (sc == before)[:, None, :, :, None].astype(mx.float32)
    carry_out = (sc == sc[..., -1:])[:, None, :, :, None].astype(mx.float32)
    return pair, carry_in, carry_out


def _carry_run(u, w, qc, qk, kl, keep, h, states=None, writes=None):
    """The state carried chunk to chunk: each chunk's outputs [B, H, N, C, Dv] and the last
    state. ``w`` None: no delta correction (each chunk writes ``u`` as it is). ``states``,
    ``writes``: lists that get each chunk's entering state and its Delta."""
    ys = []
    for i in range(u.shape[2]):
        d = u[:, :, i] if w is None else u[:, :, i] - w[:, :, i] @ h
        if states is not None:
            states.append(h)
            writes.append(d)
        ys.append(qc[:, :, i] @ h + qk[:, :, i] @ d)
        h = keep[:, :, i][..., None] * h + mx.swapaxes(kl[:, :, i], -1, -2) @ d
    return mx.stack(ys, axis=2), h


@mx.custom_function
def _carry(u, w, qc, qk, kl, keep, h0):
    """``_carry_run`` with a backward of its own: the reverse recurrence over the chunks, from
    the states the forward entered them with (recomputed). MLX's own backward through the
    loop would give each chunk's slice of the inputs a full-size gradient (memory T^2 / C)."""
    return _carry_run(u, w, qc, qk, kl, keep, h0)


@_carry.vjp
def _carry_vjp(primals, cotangents, outputs):
    u, w, qc, qk, kl, keep, h0 = primals
    return _carry_grads(u, w, qc, qk, kl, keep, h0, cotangents, outputs)


@mx.custom_function
def _carry_plain(u, qc, qk, kl, keep, h0):
    """``_carry`` without the delta correction."""
    return _carry_run(u, None, qc, qk, kl, keep, h0)


@_carry_plain.vjp
def _carry_plain_vjp(primals, cotangents, outputs):
    u, qc, qk, kl, keep, h0 = primals
    du, _, *rest = _carry_grads(u, None, qc, qk, kl, keep, h0, cotangents, outputs)
    return (du, *rest)


def _carry_grads(u, w, qc, qk, kl, keep, h0, cotangents, outputs):
    """The carry's gradients (u, w (None without the correction), qc, qk, kl, keep, h0): the
    reverse recurrence over the chunks."""
    dy, dh = cotangents
    states, writes = [], []
    _carry_run(u, w, qc, qk, kl, keep, h0, states, writes)
    dh = mx.zeros_like(h0) if dh is None else dh
    dy = mx.zeros_like(outputs[0]) if dy is None else dy
    t = lambda x: mx.swapaxes(x, -1, -2)  # noqa: E731
    names = ("u", "w", "qc", "qk", "kl", "keep")
    grads = {k: [] for k in names}
    for i in reversed(range(u.shape[2])):
        h, d, dyi = states[i], writes[i], dy[:, :, i]
        dd = t(qk[:, :, i]) @ dyi + kl[:, :, i] @ dh  # Delta's gradient: [B, H, C, Dv]
        grads["qc"].append(dyi @ t(h))
        grads["qk"].append(dyi @ t(d))
        grads["kl"].append(d @ t(dh))
        dkeep = (dh * h).sum(-1)  # [B, H, Dk]
        grads["keep"].append(dkeep if keep.shape[-1] > 1 else dkeep.sum(-1, keepdims=True))
        grads["u"].append(dd)
        dh = keep[:, :, i][..., None] * dh + t(qc[:, :, i]) @ dyi
        if w is not None:
            grads["w"].append(-dd @ t(h))
            dh = dh - t(w[:, :, i]) @ dd
    stacked = [mx.stack(grads[k][::-1], axis=2) if grads[k] else None for k in names]
    return (*stacked, dh)


def log_gates(A_log: mx.array, a: mx.array, dt_bias: mx.array, lower_bound=None) -> mx.array:
    """The logarithm of mlx-lm's gates (``compute_g``, ``compute_lower_bound_g``), computed as
    such: a gate that underflows to 0 in fp32 keeps its finite logarithm."""
    rate = mx.exp(A_log.astype(mx.float32))
    if lower_bound is None:
        return -rate * nn.softplus((a + dt_bias).astype(mx.float32))
    return lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
    segment_ids: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``gated_delta_update`` (its arguments and results), computed chunkwise. A
    padding ``mask`` [B, T] keeps the state where it is False (a zero beta and a unit gate
    there) and gives zeros as y, as mlx-lm's kernel does. ``use_kernel`` has no say here: the
    caller routes by it."""
    del use_kernel
    beta = mx.sigmoid(b.astype(mx.float32))
    if allow_neg_eigval:
        beta = beta * 2.0
    log_g = log_gates(A_log, a, dt_bias, lower_bound)
    if mask is not None:
        keep = mask.astype(mx.bool_)
        beta = mx.where(keep[..., None], beta, 0.0)
        log_g = mx.where(keep.reshape(*keep.shape, *([1] * (log_g.ndim - 2))), log_g, 0.0)
    y, state = chunked_gated_delta(q, k, v, log_g, beta, state, segment_ids)
    if mask is not None:
        y = mx.where(mask[..., None, None], y, 0)
    return y, state


def ssd_update(
    hidden_states: mx.array,
    A_log: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    dt: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    time_step_limit: tuple[float, float] = (0.001, 100.0),
    mask: mx.array | None = None,
    *,
    segment_ids: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's ``ssm_update`` (Mamba-2's SSD: its arguments but ``lengths``, and its results)
    computed chunkwise, a packed example's state restarting where it starts. x
    ``hidden_states`` [B, T, H, Dh]; B, C [B, T, G, N]; dt [B, T, H] before its softplus;
    state [B, H, Dh, N]. A padding ``mask`` [B, T] keeps the state where it is False."""
    dt = nn.softplus(dt.astype(mx.float32) + dt_bias.astype(mx.float32))
    dt = mx.clip(dt, time_step_limit[0], time_step_limit[1])
    log_g = dt * -mx.exp(A_log.astype(mx.float32))
    if mask is not None:
        keep = mask.astype(mx.bool_)[..., None]
        dt = mx.where(keep, dt, 0.0)
        log_g = mx.where(keep, log_g, 0.0)
    y, state = chunked_gated_delta(C, B, hidden_states, log_g, dt, state, segment_ids, delta=False)
    y = y.astype(hidden_states.dtype) + hidden_states * D.reshape(1, 1, -1, 1)
    return y, state


def segmented_causal_conv(x: mx.array, weight: mx.array, segment_ids: mx.array) -> mx.array:
    """A depthwise causal convolution (as the linear-attention layers' short ``conv1d`` runs
    it: ``x`` [B, T + K - 1, C] is the row after K - 1 positions of carried state, ``weight``
    [C, K, 1], no padding) whose taps read only positions of the same packed example
    (``segment_ids`` [B, T]); the carried positions count as the first example's. [B, T, C]."""
    taps = weight.shape[1]
    t = segment_ids.shape[1]
    ids = mx.concatenate([mx.repeat(segment_ids[:, :1], taps - 1, axis=1), segment_ids], axis=1)
    out = None
    for j in range(taps):  # tap j reads the position K - 1 - j before
        same = (ids[:, j : j + t] == segment_ids)[..., None]
        term = mx.where(same, x[:, j : j + t] * weight[:, j, 0], 0.0)
        out = term if out is None else out + term
    return out.astype(x.dtype)


def saved_per_token(heads: int, dk: int, dv: int, vector: bool = False, delta: bool = True) -> int:
    """fp32 elements a token of one gated delta layer keeps for the backward in the chunkwise
    form: its q, k (per value head) and v in fp32; each chunk's pair matrices (the decays, q.k,
    k.k, and the inverse's log2 C factors and products); u, w and the carried q and k; the
    outputs and writes; and its share of the states carried between chunks. ``delta=False``
    (Mamba-2's SSD): the decays and q.k only, and no w."""
    c = VECTOR_CHUNK if vector else CHUNK
    steps = max(c.bit_length() - 2, 0)  # the inverse's squarings
    if delta:
        pairs = c * (4 + 2 * steps) + (2 * c * dk if vector else 0)
        vectors = 2 * dk + dv + (dv + dk) + 2 * dk + 2 * dv
    else:
        pairs = 2 * c + (c * dk if vector else 0)
        vectors = 2 * dk + dv + dv + dk + 2 * dv
    states = 2 * dk * dv // c
    return heads * (pairs + vectors + states)
