"""Attention in training: the reference form and the portable chunked tier (FlashAttention-2's
algorithm in MLX ops, which never builds the [T, T] scores; short rows build them instead, see
FUSED_SCORES).

Shapes: q [B, Hq, T, Dh], k and v [B, Hkv, T, Dh] with Hq a multiple of Hkv (grouped-query
attention); segment_ids [B, T] keeps packed sequences from attending to each other.

The chunked tier goes by slabs: a block of queries against every key it may see (under causal
masking, the keys up to the block's last query). The forward takes each slab's softmax whole and
saves the per-row logsumexp; the backward recomputes each slab's probabilities from it
(D = rowsum(dO * O), dS = P * (dP - D)). No more than a slab's [block, T] scores per head exist
at once: as in the chunked cross-entropy, ``mx.depends`` chains the slabs so that MLX does not
run them all at once.
"""

from __future__ import annotations

import contextlib
import contextvars

import mlx.core as mx

from . import cpu

# Masked scores: finite, so that a block in which a row sees nothing yet gives no NaN; every row
# sees at least one key (itself, under causal masking or within its segment).
MASKED = -1e30

# Queries per slab, at the least and in multiples.
BLOCK = 64

# The slabs are unrolled into the compiled step, a few dozen operations each forward and
# backward in every layer, and MLX holds that graph twice while a step runs (the compiled tape,
# and the arrays of the call replaying it): at SmolLM2's 30 layers about 0.12 MB a slab a layer.
# Square tiles of a fixed size made that graph grow as T^2 (351 tiles a layer at T=8192, some
# 4 GB of process memory beside MLX's 2.2 GB). A slab spans the row, so a layer holds T / block
# of them, and the block trades the graph (fewer, larger slabs) against the slab's scores
# (B x Hq x block x T). A step holds the graph of every layer but one layer's slab at a time, so
# both are least near block^2 = SLAB_AREA x layers / (SLAB_LAYERS x B x Hq), whatever T is:
# 128 queries at B=1, 9 heads and up to 8 layers (or when the layers are not known: fewer layers
# keep these slabs, their graph being small anyway), 256 at SmolLM2's 30. Measured by the
# process's maximum RSS (the graph is memory MLX's counters do not show), SmolLM2 LoRA on
# every linear layer, one checkpointed row on the CPU, T=8192: 4.20 GB with
# 128-query slabs, 3.59 GB with 256, 3.86 GB with 320; MLX's own peak the same 2.23 GB, and the
# step 17% faster with 256.
SLAB_AREA = 1 << 17
SLAB_LAYERS = 8

_LAYERS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "mlxtune_slab_layers", default=None
)


@contextlib.contextmanager
def graph_layers(n: int | None):
    """While active, ``block_for`` sizes slabs for a step whose graph holds ``n`` attention
    layers (``models.kernel_attention`` enters it with the model's). Read at trace time."""
    token = _LAYERS.set(n)
    try:
        yield
    finally:
        _LAYERS.reset(token)


def block_for(b: int, hq: int, t: int, layers: int | None = None) -> int:
    """Queries per slab for rows of ``t`` tokens at ``b`` x ``hq`` heads in a step of ``layers``
    attention layers (default: ``graph_layers``'s; at least SLAB_LAYERS): the multiple of BLOCK
    nearest sqrt(SLAB_AREA x layers / (SLAB_LAYERS x b x hq)), at least BLOCK, at most the row
    (rounded up)."""
    layers = max(layers or _LAYERS.get() or SLAB_LAYERS, SLAB_LAYERS)
    area = SLAB_AREA * layers / SLAB_LAYERS
    best = round((area / max(b * hq, 1)) ** 0.5 / BLOCK) * BLOCK
    return min(max(BLOCK, best), -(-t // BLOCK) * BLOCK)


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


def _pieces(q0: int, q1: int, t: int, causal: bool, segment_ids):
    """The keys a slab of queries [q0, q1) sees, as (k0, k1, mask) pieces: under causal masking
    without segments, the keys before the slab unmasked and the diagonal block masked (a mask
    over the whole slab costs a pass as long as the exponential's); else one masked piece."""
    end = q1 if causal else t
    if causal and segment_ids is None and q0 > 0:
        return [(0, q0, None), (q0, q1, _mask(q0, q1, q0, q1, True, None))]
    return [(0, end, _mask(q0, q1, 0, end, causal, segment_ids))]


def _slabs_forward(q, k, v, scale, causal, segment_ids, blocks):
    """Each query block's softmax over the keys it may see: (out, logsumexp per query row)."""
    hkv, t = k.shape[1], k.shape[2]
    qg = _group(q, hkv).astype(mx.float32)
    kf = k[:, :, None].astype(mx.float32)
    vf = v[:, :, None].astype(mx.float32)
    outs, lses = [], []
    last = []  # what the next slab waits for, so that MLX runs the slabs one after another
    for q0, q1 in blocks:
        qb = mx.depends(qg[..., q0:q1, :], last) if last else qg[..., q0:q1, :]
        pieces = _pieces(q0, q1, t, causal, segment_ids)
        scores = [_scores(qb, kf[..., k0:k1, :], scale, mask) for k0, k1, mask in pieces]
        m = scores[0].max(axis=-1)
        for s in scores[1:]:
            m = mx.maximum(m, s.max(axis=-1))
        l = out = None  # noqa: E741
        for s, (k0, k1, _) in zip(scores, pieces, strict=True):
            p = cpu.exp_of_nonpositive(s - m[..., None])
            o = p @ vf[..., k0:k1, :]
            l = p.sum(axis=-1) if l is None else l + p.sum(axis=-1)  # noqa: E741
            out = o if out is None else out + o
        out = out / l[..., None]
        lse = m + mx.log(l)
        outs.append(out)
        lses.append(lse)
        last = [out, lse]
    out = mx.concatenate(outs, axis=-2).reshape(q.shape).astype(q.dtype)
    return out, mx.concatenate(lses, axis=-1)


def _padded(x, k0: int, k1: int, t: int):
    """A [B, Hkv, k1 - k0, D] gradient of keys [k0, k1) as the row's [B, Hkv, t, D]."""
    if k0 == 0 and k1 == t:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (k0, t - k1), (0, 0)])


def _slabs_backward(q, k, v, d_out, out, lse, scale, causal, segment_ids, blocks):
    """The backward over the same slabs, recomputing each slab's probabilities from the saved
    logsumexp: (dq, dk, dv). A slab's key and value gradients reach its keys only, and are
    added into the row's padded."""
    hkv, t = k.shape[1], k.shape[2]
    d_out = _group(d_out, hkv).astype(mx.float32)
    qg = _group(q, hkv).astype(mx.float32)
    kf = k[:, :, None].astype(mx.float32)
    vf = v[:, :, None].astype(mx.float32)
    delta = (d_out * _group(out, hkv).astype(mx.float32)).sum(axis=-1)  # D = rowsum(dO * O)
    dqs = []
    dk = dv = None
    last = []
    for q0, q1 in blocks:
        qb = mx.depends(qg[..., q0:q1, :], last) if last else qg[..., q0:q1, :]
        dob = d_out[..., q0:q1, :]
        dq = None
        for k0, k1, mask in _pieces(q0, q1, t, causal, segment_ids):
            kb, vb = kf[..., k0:k1, :], vf[..., k0:k1, :]
            p = cpu.exp_of_nonpositive(_scores(qb, kb, scale, mask) - lse[..., q0:q1, None])
            dp = dob @ vb.swapaxes(-1, -2)
            ds = p * (dp - delta[..., q0:q1, None]) * scale
            dq = ds @ kb if dq is None else dq + ds @ kb
            # sum over the query heads of each group: [B, Hkv, G, q, k] -> [B, Hkv, k, D]
            dk_s = _padded((ds.swapaxes(-1, -2) @ qb).sum(axis=2), k0, k1, t)
            dv_s = _padded((p.swapaxes(-1, -2) @ dob).sum(axis=2), k0, k1, t)
            dk = dk_s if dk is None else dk + dk_s
            dv = dv_s if dv is None else dv + dv_s
        dqs.append(dq)
        last = [dq, dk, dv]
    dq = mx.concatenate(dqs, axis=-2).reshape(q.shape).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def attention_chunked(q, k, v, scale, causal=True, segment_ids=None, block=None):
    """Attention's forward and backward by slabs of ``block`` queries against the keys they see
    (``block_for`` sizes them unless ``block`` is given), in MLX ops. Under causal masking a
    slab ends at its last query: about half the work (and half the exponentials, which bound the
    CPU) of the full scores. Short rows, whose scores hold at most
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
        return _slabs_forward(q, k, v, scale, causal, segment_ids, blocks)

    @attn.vjp
    def attn_vjp(primals, cotangents, outputs):
        out, lse = outputs
        return _slabs_backward(
            *primals, cotangents[0], out, lse, scale, causal, segment_ids, blocks
        )

    out, _ = attn(q, k, v)
    return out
