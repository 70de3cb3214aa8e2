"""The portable tier: MLX ops only, every backend; the executable specification of the
blockwise algorithm the Metal and CUDA kernels implement.

linear_cross_entropy never builds the [N, V] logits. The forward streams over vocabulary
chunks with an online logsumexp; the backward recomputes each chunk's logits and turns them into
the gradient in place. Two things keep the peak at one chunk rather than all of them:

- ``mx.custom_function``: autograd does not keep the forward's chunks for the backward.
- Every chunk step depends on the previous one through a single packed state, so MLX's
  depth-first evaluation finishes (and frees) chunk k before it starts chunk k+1. Reductions
  that each read a chunk but lived in separate chains would let all chunks be computed up
  front, because the first chain would pull every chunk in before the others ran.

The weight's gradient comes from the same recomputed chunk as the hidden state's. A frozen head
(LoRA, ``weight_grad=False``) needs no recomputation: its forward carries the softmax-weighted
head rows along chunk by chunk (rescaled as the running maximum grows), which is the hidden
state's gradient up to the target's row, so the backward makes no pass over the vocabulary.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import mlx.core as mx

from . import cpu

# Elements of one [N, C] chunk of logits (fp32) on the CPU: 2**20 is 4 MB. MLX's scheduler keeps a
# few ops in flight, so the peak is some ten chunks: measured at N=2048, V=32768 (compiled, with
# the weight's gradient) 62 MB against the naive path's 814 MB.
CHUNK_ELEMENTS = 1 << 20
# ... on a GPU: 2**24 (64 MB). The CPU's size left an H200 a chunk of 256 columns at N=4096 (594
# chunks at V=152064, each a GEMM too small to fill the device and a kernel launch), the loss
# 7-12x the naive form's time (bench/device/README.md); 2**24 makes it 37 chunks of 4,096
# columns, some 0.6 GB in flight, small beside such a GPU's memory.
GPU_CHUNK_ELEMENTS = 1 << 24


class QuantizedRows:
    """A quantized [V, D] head (MLX's packed codes, scales and biases), times ``scale``, read a
    block of rows at a time: ``rows[a:b]`` and ``rows[ids]`` de-quantize only those rows. The
    chunked loss takes it where it takes a dense weight; ``dense()`` is the whole matrix."""

    def __init__(self, codes, scales, biases, group_size, bits, mode="affine", scale=1.0):
        self.codes, self.scales, self.biases = codes, scales, biases
        self.group_size, self.bits, self.mode, self.scale = group_size, bits, mode, scale
        self.shape = (codes.shape[0], scales.shape[1] * group_size)
        self.ndim = 2
        # the product's dtype: the scales' (affine), or fp32 where they are exponents (mxfp4)
        floating = mx.issubdtype(scales.dtype, mx.floating)
        self.dtype = scales.dtype if floating else mx.float32

    def arrays(self) -> list:
        return [a for a in (self.codes, self.scales, self.biases) if a is not None]

    def with_arrays(self, arrays) -> QuantizedRows:
        codes, scales, *rest = arrays
        return QuantizedRows(
            codes, scales, rest[0] if rest else None, self.group_size, self.bits, self.mode,
            self.scale,
        )  # fmt: skip

    def __getitem__(self, rows) -> mx.array:
        w = mx.dequantize(
            self.codes[rows],
            self.scales[rows],
            None if self.biases is None else self.biases[rows],
            self.group_size,
            self.bits,
            mode=self.mode,
        )
        return w if self.scale == 1.0 else w * self.scale

    def block(self, start: int, stop: int, after=None) -> mx.array:
        """Rows ``start:stop`` de-quantized, computed only once ``after`` is (the previous
        chunk's state: MLX's scheduler would otherwise de-quantize every chunk up front)."""
        if after is None:
            return self[start:stop]
        codes, *rest = (a[start:stop] for a in self.arrays())
        return self.with_arrays([mx.depends(codes, after), *rest])[:]

    def dense(self) -> mx.array:
        return self[:]

    def times_transposed(self, x: mx.array) -> mx.array:
        """``x @ dense().T`` [..., V] straight from the codes (MLX's quantized matmul)."""
        z = mx.quantized_matmul(
            x.astype(self.dtype), self.codes, self.scales, self.biases, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        )  # fmt: skip
        return z if self.scale == 1.0 else z * self.scale

    def astype(self, dtype) -> mx.array:
        return self.dense().astype(dtype)


def dense(weight) -> mx.array:
    """A weight as a dense array (``QuantizedRows`` de-quantized whole)."""
    return weight.dense() if isinstance(weight, QuantizedRows) else weight


def _chunk(w, start: int, c: int, after) -> mx.array:
    """Rows ``start:start + c`` of a head (a quantized one de-quantized once ``after`` is)."""
    if isinstance(w, QuantizedRows):
        return w.block(start, start + c, after)
    return w[start : start + c]


def chunk_elements() -> int:
    """Logits a chunk holds on the default device: CHUNK_ELEMENTS on the CPU, GPU_CHUNK_ELEMENTS
    on a GPU."""
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    return GPU_CHUNK_ELEMENTS if on_gpu else CHUNK_ELEMENTS


def chunk_size(n: int, v: int, elements: int | None = None) -> int:
    """Vocabulary columns per chunk: about ``elements`` logits (``chunk_elements()`` unless
    given), a multiple of 256, at most V."""
    elements = elements or chunk_elements()
    c = max(256, (elements // max(n, 1)) // 256 * 256)
    return min(c, v)


def chunk_starts(v: int, c: int) -> mx.array:
    """Each chunk's first column, as an array made in the graph: ``chunk_starts(v, c)[k]`` is
    chunk k's offset. The per-chunk arithmetic takes its offset from here, not as a Python
    number, because ``mx.compile`` writes scalar constants into the source of the kernels it
    fuses: one number per chunk would make a distinct kernel per chunk, and on a GPU each is a
    JIT build of a second or more (minutes for a 32k vocabulary's first step)."""
    return mx.arange(0, v, c, dtype=mx.int32)


def _logits(h, w_chunk, softcap):
    """fp32 logits of one chunk, soft-capped when asked."""
    z = (h @ w_chunk.T).astype(mx.float32)
    if softcap is not None:
        z = softcap * cpu.tanh(z / softcap)
    return z


def _forward(h, w, t, valid, c, label_smoothing, softcap):
    """Per-token (logsumexp, target logit, sum of logits), as one packed [N, 3] state."""
    n, v = h.shape[0], w.shape[0]
    state = mx.stack([mx.full((n,), -math.inf), mx.zeros((n,)), mx.zeros((n,))], axis=-1)
    starts = chunk_starts(v, c)
    for k, start in enumerate(range(0, v, c)):
        # chunk k's logits only once chunk k-1 is folded into the state: evaluated eagerly (not
        # compiled), MLX's scheduler would otherwise build every chunk's logits at once
        after = mx.depends(h, state) if start else h
        z = _logits(after, _chunk(w, start, c, state if start else None), softcap)
        width = z.shape[1]
        local = t - starts[k]
        inside = (local >= 0) & (local < width) & valid
        picked = mx.take_along_axis(z, mx.clip(local, 0, width - 1)[:, None], axis=-1)[:, 0]
        lse = mx.logaddexp(state[:, 0], cpu.logsumexp(z))
        target = state[:, 1] + mx.where(inside, picked, 0.0)
        total = state[:, 2] + (z.sum(axis=-1) if label_smoothing > 0 else 0.0)
        state = mx.stack([lse, target, total], axis=-1)
    return state


def _chunk_grad(h, w_chunk, t, start, lse, g, label_smoothing, softcap, v):
    """d loss / d raw logits of one chunk, [N, C] (g: the per-token cotangent, 0 if ignored;
    ``start``: the chunk's offset, a scalar array from ``chunk_starts``)."""
    z = _logits(h, w_chunk, softcap)
    p = cpu.exp_of_nonpositive(z - lse[:, None])
    width = z.shape[1]
    hit = (mx.arange(width)[None, :] + start) == t[:, None]
    dz = p - (1.0 - label_smoothing) * hit.astype(mx.float32)
    if label_smoothing > 0:
        dz = dz - label_smoothing / v
    dz = dz * g[:, None]
    if softcap is not None:
        dz = dz * (1.0 - mx.square(z / softcap))
    return dz


def token_losses(lse, target, total, valid, label_smoothing, v):
    """Per-token losses from the logsumexp, target logit and sum of logits (0 where ignored)."""
    nll = lse - target
    if label_smoothing > 0:
        nll = (1 - label_smoothing) * nll + label_smoothing * (lse - total / v)
    return mx.where(valid, nll, 0.0)


def backward_over_chunks(h, w, c, chunk_grad, weight_grad, operands=None):
    """(d hidden, d weight) from each chunk's d loss / d logits, ``chunk_grad(h, w_chunk,
    start)`` (``start`` a scalar array, see ``chunk_starts``), one chunk at a time; with
    ``weight_grad=False`` d weight is zeros. The two gradient matmuls take their operands in
    ``operands`` (fp32 unless given: the GPU tiers give the inputs' dtype, whose GEMMs
    accumulate in fp32 at 16-bit speed); d hidden is summed over the chunks in fp32."""
    operands = operands or mx.float32
    hf = h.astype(operands)
    dh = mx.zeros(h.shape, dtype=mx.float32)
    pieces = []
    starts = chunk_starts(w.shape[0], c)
    for k, start in enumerate(range(0, w.shape[0], c)):
        # chunk k starts only once everything reading chunk k-1's tile is done, or MLX's
        # scheduler would run ahead and hold many tiles at once
        after = mx.depends(h, [dh, pieces[-1]] if pieces else dh)
        wc = _chunk(w, start, c, dh if start else None)
        dz = chunk_grad(after, wc, starts[k]).astype(operands)
        if operands == mx.float32:
            dh = mx.addmm(dh, dz, wc.astype(mx.float32))
        else:
            dh = dh + (dz @ wc.astype(operands)).astype(mx.float32)
        if weight_grad:
            pieces.append((dz.T @ hf).astype(w.dtype))
    if weight_grad:
        dw = mx.concatenate(pieces, axis=0)
    else:  # a frozen head's: zeros (none for QuantizedRows, whose arrays the caller zeroes)
        dw = mx.zeros_like(w) if isinstance(w, mx.array) else None
    return dh.astype(h.dtype), dw


def _forward_frozen(h, w, t, valid, c, label_smoothing, softcap):
    """The forward of a frozen head, gathering what the hidden state's gradient needs on the way:
    per token the running maximum m, the sum s of e^(z - m), the target logit, the sum of logits,
    and ``acc`` = sum over the vocabulary of e^(z - m) dz/draw W (the softmax-weighted head rows,
    rescaled whenever m grows, as flash attention rescales its output), as one packed
    [N, D + 4] state. The softmax's part of d loss / d hidden is then acc / s, and the backward
    needs no pass over the vocabulary."""
    n, v, d = h.shape[0], w.shape[0], h.shape[1]
    stats = mx.stack(
        [mx.full((n,), -math.inf), mx.zeros((n,)), mx.zeros((n,)), mx.zeros((n,))], axis=-1
    )
    state = mx.concatenate([mx.zeros((n, d)), stats], axis=1)
    starts = chunk_starts(v, c)
    for k, start in enumerate(range(0, v, c)):
        after = mx.depends(h, state) if start else h  # one tile at a time
        wc = _chunk(w, start, c, state if start else None)
        z = _logits(after, wc, softcap)
        width = z.shape[1]
        acc, m = state[:, :d], state[:, d]
        local = t - starts[k]
        inside = (local >= 0) & (local < width) & valid
        picked = mx.take_along_axis(z, mx.clip(local, 0, width - 1)[:, None], axis=-1)[:, 0]
        m_new = mx.maximum(m, z.max(axis=-1))
        shrink = cpu.exp_of_nonpositive(m - m_new)  # 0 on the first chunk (m = -inf)
        e = cpu.exp_of_nonpositive(cpu.materialized(z - m_new[:, None]))
        weighted = e if softcap is None else e * (1.0 - mx.square(z / softcap))
        acc = mx.addmm(acc * shrink[:, None], weighted, wc.astype(mx.float32))
        sums = state[:, d + 1] * shrink + e.sum(axis=-1)
        target = state[:, d + 2] + mx.where(inside, picked, 0.0)
        total = state[:, d + 3] + (z.sum(axis=-1) if label_smoothing > 0 else 0.0)
        state = mx.concatenate([acc, mx.stack([m_new, sums, target, total], axis=-1)], axis=1)
    return state


_FORWARD_ONLY = contextvars.ContextVar("mlxtune_forward_only", default=False)


@contextlib.contextmanager
def forward_only():
    """Inside it, ``linear_cross_entropy`` calls are promised no backward (evaluation): the
    chunked tier's frozen-head path, which gathers the hidden state's gradient during the
    forward, then computes the loss alone. Set it around the code ``mx.compile`` traces (the
    flag is read at trace time)."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def linear_cross_entropy_chunked(
    hidden, weight, targets, ignore_index, label_smoothing, softcap, chunk=None, weight_grad=True
):
    """Per-token losses [N] (0 where ignored) and the valid mask [N], chunked over the vocabulary.

    With ``weight_grad=False`` (a frozen head) the weight's gradient is reported as zeros, and the
    forward gathers the hidden state's gradient as it goes (``_forward_frozen``): two matmuls and
    one exponential per chunk instead of three and two, forward and backward together. Inside
    ``forward_only()`` (evaluation) the forward computes the loss alone."""
    n, v = hidden.shape[0], weight.shape[0]
    c = chunk or chunk_size(n, v)
    if isinstance(weight, QuantizedRows) and not chunk:
        # a chunk's de-quantized rows count too: at most four chunks' worth of logits
        c = min(c, chunk_size(weight.shape[1], v, 4 * chunk_elements()))
    valid = targets != ignore_index
    safe = mx.where(valid, targets, 0)
    # a soft cap with label smoothing would need a second softmax-free sum over the vocabulary
    gather = (
        not weight_grad and not _FORWARD_ONLY.get() and (softcap is None or label_smoothing == 0)
    )

    quantized = isinstance(weight, QuantizedRows)
    if quantized and weight_grad:
        raise ValueError("a quantized head does not train: pass weight_grad=False")

    def head(arrays):
        return weight.with_arrays(arrays) if quantized else arrays[0]

    @mx.custom_function
    def losses_fn(h, t, *arrays):
        w = head(arrays)
        if gather:
            state = _forward_frozen(h, w, t, valid, c, label_smoothing, softcap)
            d = h.shape[1]
            sums = state[:, d + 1]
            lse = state[:, d] + mx.log(sums)
            target, total = state[:, d + 2], state[:, d + 3]
            # the softmax-weighted head rows ride along for the backward
            extra = state[:, :d] / sums[:, None]
        else:
            state = _forward(h, w, t, valid, c, label_smoothing, softcap)
            lse, target, total = state[:, 0], state[:, 1], state[:, 2]
            extra = lse  # lse rides along so the backward does not recompute the forward
        return token_losses(lse, target, total, valid, label_smoothing, v), extra

    @losses_fn.vjp
    def losses_vjp(primals, cotangents, outputs):
        h, t, *arrays = primals
        w = head(arrays)
        frozen = [mx.zeros_like(a) for a in arrays]
        g = mx.where(valid, cotangents[0].astype(mx.float32), 0.0)
        if gather:
            # d loss / d h = sum_v p_v c_v W_v - (1 - eps) c_t W_t - eps/V sum_v c_v W_v, where
            # c = d capped / d raw logit (1 without a soft cap; a cap with smoothing goes the
            # other way)
            wt = w[t].astype(mx.float32)
            if softcap is not None:  # the target logit's d capped / d raw
                raw = (h.astype(mx.float32) * wt).sum(axis=-1, keepdims=True)
                wt = wt * (1.0 - mx.square(cpu.tanh(raw / softcap)))
            dh = outputs[1] - (1.0 - label_smoothing) * wt
            if label_smoothing > 0:
                dh = dh - label_smoothing * w.astype(mx.float32).mean(axis=0)
            return ((dh * g[:, None]).astype(h.dtype), mx.zeros_like(t), *frozen)
        lse = outputs[1]

        def chunk_grad(after, wc, start):
            return _chunk_grad(after, wc, t, start, lse, g, label_smoothing, softcap, v)

        dh, dw = backward_over_chunks(h, w, c, chunk_grad, weight_grad)
        return (dh, mx.zeros_like(t), *([dw] if weight_grad else frozen))

    arrays = weight.arrays() if quantized else [weight]
    losses, _ = losses_fn(hidden, safe, *arrays)
    return losses, valid


def linear_entropy_chunked(hidden, weight, softcap=None, chunk=None) -> mx.array:
    """Entropy [N] (fp32, nats) of softmax(z) for each row of z = hidden @ weight.T (soft-capped
    as the loss caps it), streamed over vocabulary chunks as the loss's forward streams its
    logsumexp: per row the running maximum m, s = sum e^(z - m) and t = sum e^(z - m) (z - m),
    both rescaled when m grows, so H = log s - t / s (z - m, not z, keeps the difference of two
    large numbers out of it). Only an [N, chunk] block of logits exists at a time; no gradient
    flows (forward only)."""
    n, v = hidden.shape[0], weight.shape[0]
    c = chunk or chunk_size(n, v)
    if isinstance(weight, QuantizedRows) and not chunk:
        c = min(c, chunk_size(weight.shape[1], v, 4 * chunk_elements()))
    h = mx.stop_gradient(hidden)
    weight = mx.stop_gradient(weight) if isinstance(weight, mx.array) else weight
    state = None  # [N, 3]: m, s, t
    for start in range(0, v, c):
        # chunk k only once chunk k-1 is folded in (one block of logits at a time, as _forward)
        after = h if state is None else mx.depends(h, state)
        z = _logits(after, _chunk(weight, start, c, state), softcap)
        top = z.max(axis=-1)
        if state is None:
            m, s, t = top, 0.0, 0.0
        else:
            old, s, t = state[:, 0], state[:, 1], state[:, 2]
            m = mx.maximum(old, top)
            shrink = cpu.exp_of_nonpositive(old - m)
            s, t = s * shrink, (t + s * (old - m)) * shrink
        d = cpu.materialized(z - m[:, None])
        e = cpu.exp_of_nonpositive(d)
        state = mx.stack([m, s + e.sum(axis=-1), t + (e * d).sum(axis=-1)], axis=-1)
    return mx.log(state[:, 1]) - state[:, 2] / state[:, 1]
