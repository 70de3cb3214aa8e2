"""Attention in training: the reference form and the portable chunked tier (FlashAttention-2's
algorithm in MLX ops, which never builds the [T, T] scores; short rows build them instead, see
FUSED_SCORES).

Shapes: q [B, Hq, T, Dh], k and v [B, Hkv, T, Dh] with Hq a multiple of Hkv (grouped-query
attention); segment_ids [B, T] keeps packed sequences from attending to each other.

The chunked forward streams over key blocks with an online softmax and saves the per-row
logsumexp; the backward recomputes each block's probabilities from it (D = rowsum(dO * O),
dS = P * (dP - D)) and never holds more than one [T, block] tile per head. As in the chunked
cross-entropy, ``mx.depends`` chains the blocks so that MLX does not run them all at once.
"""

from __future__ import annotations

import mlx.core as mx

from . import cpu

# Masked scores: finite, so that a block in which a row sees nothing yet gives no NaN; every row
# sees at least one key (itself, under causal masking or within its segment).
MASKED = -1e30

# Keys per block of the chunked tier, at the least. MLX keeps a few tiles in flight; at B=1, 8
# heads, T=2048, Dh=64 the compiled forward+backward with 64-key blocks peaks at 83 MB against
# the naive path's 434 MB (0.19x).
BLOCK = 64

# The tiles are unrolled into the graph, about (T / block)^2 / 2 of them forward and backward in
# every layer, so a fixed block makes the compiled step grow with the layers x T^2: SmolLM2's 30
# layers at T=4096 spent minutes compiling 64-key tiles. So blocks grow with the row: a tile
# holds up to TILE_SCORES score elements (B x Hq x block x block; 4 MB in fp32), and a row is
# cut into at most MAX_BLOCKS blocks once that allows (attention memory then grows as T x block).
TILE_SCORES = 1 << 20
MAX_BLOCKS = 32


def block_for(b: int, hq: int, t: int) -> int:
    """Keys per block for rows of ``t`` tokens at ``b`` x ``hq`` heads: a multiple of BLOCK, as
    large as TILE_SCORES allows and at least t / MAX_BLOCKS, at most the row."""
    by_memory = int((TILE_SCORES / max(b * hq, 1)) ** 0.5) // BLOCK * BLOCK
    by_count = -(-t // MAX_BLOCKS)
    blk = max(BLOCK, by_memory, -(-by_count // BLOCK) * BLOCK)
    return min(blk, -(-t // BLOCK) * BLOCK)


# Up to this many score elements (B x Hq x T x T; 64 MB in fp32), the chunked tier builds the
# scores instead of tiling them: MLX's fused attention on a GPU, and on the CPU cpu.attention,
# whose exponentials are vectorised (mx.exp is not) and which skips most causal upper blocks.
# Scores of this size are small next to the activations of the same batch.
FUSED_SCORES = 1 << 24


def _group(q, hkv):
    """[B, Hq, T, D] -> [B, Hkv, G, T, D]: the query heads that share one key/value head."""
    b, hq, t, d = q.shape
    return q.reshape(b, hkv, hq // hkv, t, d)


def _mask(q0: int, q1: int, k0: int, k1: int, causal: bool, segment_ids):
    """Which keys [k0, k1) the queries [q0, q1) may see: [B or 1, 1, 1, q, k] bool, or None when
    every pair may (a tile wholly below the causal diagonal, without segments)."""
    mask = None
    if causal and k1 - 1 > q0:  # the tile reaches above the diagonal
        mask = (mx.arange(k0, k1)[None, :] <= mx.arange(q0, q1)[:, None])[None, None, None]
    if segment_ids is not None:
        same = segment_ids[:, q0:q1, None] == segment_ids[:, None, k0:k1]
        same = same[:, None, None]
        mask = same if mask is None else mask & same
    return mask


def attention_reference(q, k, v, scale, causal=True, segment_ids=None):
    """softmax(q k^T * scale + mask) v, building the scores: the form every tier is tested against."""
    hkv = k.shape[1]
    qg = _group(q, hkv).astype(mx.float32)
    s = (qg @ k[:, :, None].astype(mx.float32).swapaxes(-1, -2)) * scale
    t = q.shape[2]
    mask = _mask(0, t, 0, t, causal, segment_ids)
    if mask is not None:
        s = mx.where(mask, s, MASKED)
    p = mx.softmax(s, axis=-1)
    out = p @ v[:, :, None].astype(mx.float32)
    return out.reshape(q.shape).astype(q.dtype)


def _scores(qg, kb, scale, mask):
    s = (qg @ kb.swapaxes(-1, -2)) * scale
    return s if mask is None else mx.where(mask, s, MASKED)


def attention_native(q, k, v, scale, causal=True, segment_ids=None):
    """MLX's own fused attention (``mx.fast.scaled_dot_product_attention``), with segments and
    causality as a boolean mask. Its backward builds the [B, Hq, T, T] scores."""
    if segment_ids is None:
        return mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal" if causal else None
        )
    allowed = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    if causal:
        t = q.shape[2]
        allowed = allowed & mx.tril(mx.ones((t, t), dtype=mx.bool_))
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=allowed)


def uses_fused(b: int, hq: int, t: int) -> bool:
    """Whether the chunked tier hands these shapes to MLX's fused attention (see FUSED_SCORES)."""
    return b * hq * t * t <= FUSED_SCORES


def _tiles_forward(q, k, v, scale, causal, segment_ids, blocks):
    """Online-softmax forward over query x key tiles: (out, logsumexp per query row)."""
    hkv = k.shape[1]
    qg = _group(q, hkv).astype(mx.float32)
    kf = k[:, :, None].astype(mx.float32)
    vf = v[:, :, None].astype(mx.float32)
    outs, lses = [], []
    last = []  # what the next tile waits for, so that MLX runs the tiles one after another
    for q0, q1 in blocks:
        qb = qg[..., q0:q1, :]
        m = mx.full(qb.shape[:-1], MASKED)
        l = mx.zeros(qb.shape[:-1])  # noqa: E741
        acc = mx.zeros(qb.shape)
        for k0, k1 in blocks:
            if causal and k0 >= q1:
                continue  # above the diagonal: never computed
            after = mx.depends(qb, last) if last else qb
            s = _scores(after, kf[..., k0:k1, :], scale, _mask(q0, q1, k0, k1, causal, segment_ids))
            m_new = mx.maximum(m, s.max(axis=-1))
            p = cpu.exp_of_nonpositive(s - m_new[..., None])
            alpha = cpu.exp_of_nonpositive(m - m_new)
            l = alpha * l + p.sum(axis=-1)  # noqa: E741
            acc = alpha[..., None] * acc + p @ vf[..., k0:k1, :]
            m = m_new
            last = [acc, l, m]
        outs.append(acc / l[..., None])
        lses.append(m + mx.log(l))
    out = mx.concatenate(outs, axis=-2).reshape(q.shape).astype(q.dtype)
    return out, mx.concatenate(lses, axis=-1)


def _tiles_backward(q, k, v, d_out, out, lse, scale, causal, segment_ids, blocks):
    """FlashAttention-2 backward over the same tiles, recomputing each tile's probabilities from
    the saved logsumexp: (dq, dk, dv)."""
    hkv = k.shape[1]
    d_out = _group(d_out, hkv).astype(mx.float32)
    qg = _group(q, hkv).astype(mx.float32)
    kf = k[:, :, None].astype(mx.float32)
    vf = v[:, :, None].astype(mx.float32)
    delta = (d_out * _group(out, hkv).astype(mx.float32)).sum(axis=-1)  # D = rowsum(dO * O)
    dq = [None] * len(blocks)
    dks, dvs = [], []
    last = []
    for k0, k1 in blocks:
        kb, vb = kf[..., k0:k1, :], vf[..., k0:k1, :]
        dk = dv = None
        for i, (q0, q1) in enumerate(blocks):
            if causal and k0 >= q1:
                continue  # above the diagonal: nothing to do
            qb = qg[..., q0:q1, :]
            after = mx.depends(qb, last) if last else qb
            s = _scores(after, kb, scale, _mask(q0, q1, k0, k1, causal, segment_ids))
            p = cpu.exp_of_nonpositive(s - lse[..., q0:q1, None])
            dob = d_out[..., q0:q1, :]
            dp = dob @ vb.swapaxes(-1, -2)
            ds = p * (dp - delta[..., q0:q1, None]) * scale
            dq[i] = ds @ kb if dq[i] is None else dq[i] + ds @ kb
            # sum over the query heads of each group: [B, Hkv, G, q, k] -> [B, Hkv, k, D]
            dk_t = (ds.swapaxes(-1, -2) @ qb).sum(axis=2)
            dv_t = (p.swapaxes(-1, -2) @ dob).sum(axis=2)
            dk = dk_t if dk is None else dk + dk_t
            dv = dv_t if dv is None else dv + dv_t
            last = [dq[i], dk, dv]
        dks.append(dk)
        dvs.append(dv)
    dq = mx.concatenate(dq, axis=-2).reshape(q.shape).astype(q.dtype)
    dk = mx.concatenate(dks, axis=2).astype(k.dtype)
    dv = mx.concatenate(dvs, axis=2).astype(v.dtype)
    return dq, dk, dv


def attention_chunked(q, k, v, scale, causal=True, segment_ids=None, block=None):
    """FlashAttention-2 forward and backward over [block x block] tiles (``block_for`` sizes them
    unless ``block`` is given), in MLX ops. Under causal
    masking the tiles above the diagonal are never computed: about half the work (and half the
    exponentials, which bound the CPU) of the full scores. Short rows, whose scores hold at most
    FUSED_SCORES elements, go to MLX's fused attention instead (``cpu.attention`` on the CPU),
    unless ``block`` is given."""
    b, hq, t, d = q.shape
    if block is None and uses_fused(b, hq, t):
        if mx.default_device() == mx.cpu:
            # the same probabilities with a vectorised exp, the causal upper blocks left out
            return cpu.attention(q, k, v, scale, causal, segment_ids)
        return attention_native(q, k, v, scale, causal, segment_ids)
    blk = block or block_for(b, hq, t)
    blocks = [(s0, min(s0 + blk, t)) for s0 in range(0, t, blk)]

    @mx.custom_function
    def attn(q, k, v):
        return _tiles_forward(q, k, v, scale, causal, segment_ids, blocks)

    @attn.vjp
    def attn_vjp(primals, cotangents, outputs):
        out, lse = outputs
        return _tiles_backward(
            *primals, cotangents[0], out, lse, scale, causal, segment_ids, blocks
        )

    out, _ = attn(q, k, v)
    return out
