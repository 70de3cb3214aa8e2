"""The GPU tiers ("metal", "cuda"): the chunked tier's blocks, with the work inside each block
done by one kernel written once for both backends (``mlxtune.metal_kernels``).

linear_cross_entropy keeps the chunked tier's loop over vocabulary chunks. The matmuls stay
MLX's own (its GEMMs are the fastest on each device); what the kernels fuse is everything
between them, which the chunked tier spends several passes over the [N, C] chunk on:

- forward: ``lce_forward`` folds a chunk's logits into each row's running (max, sum of exp,
  target logit, sum of logits) in one pass: the online logsumexp, softcap included;
- backward: ``lce_backward`` turns a recomputed chunk of logits into d loss / d logits in one pass
  (softmax minus the smoothed one-hot, times the cotangent and the softcap's derivative).

attention is FlashAttention-2 in three kernels: ``attn_forward`` (online softmax over key tiles,
saving the row logsumexp), ``attn_dq`` and ``attn_dkv`` (recomputing P and dS tile by tile);
scores exist only as one tile in threadgroup memory. Head sizes the kernels do not take (not a
multiple of 4, or above 256) go to the chunked tier.

Each tier is built from a *launcher*, the function that runs a kernel: ``mx.fast.metal_kernel``
or ``mx.fast.cuda_kernel`` on a GPU, or the CPU emulator (``metal_kernels.emulate``) in tests, so
the code below is the same whichever runs the kernels.

Where MLX's own operation was measured to beat the kernels on a backend, the tier hands those
shapes to it (``MLX_WINS``), as it hands head sizes the kernels do not take to the chunked tier.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..metal_kernels import (
    ATTN_DKV,
    ATTN_DQ,
    ATTN_FORWARD,
    LCE_BACKWARD,
    LCE_FORWARD,
    Kernel,
    attention_block,
    header,
    source,
)
from .chunked import backward_over_chunks, chunk_size, chunk_starts, token_losses
from .flash import attention_chunked, attention_native
from .reference import linear_cross_entropy_reference

# Threads per group of the cross-entropy kernels (a multiple of 32).
LCE_THREADS = 256

# Where MLX's own operation beats the kernels, by backend: measured with bench/kernels.py --gpu
# (bf16, compiled forward+backward with respect to every input, median of three; peak memory
# with no memory limit set) on an NVIDIA H200 under MLX 0.32.4's CUDA backend, 2026-11-26.
# bench/device/README.md has every row of that run. Shapes not listed keep the kernels.
#
# | backend | operation | shapes handed to MLX | MLX's operation | MLX / the kernels, measured |
# | --- | --- | --- | --- | --- |
# | cuda | attention | no segments; bf16 or fp16; head dim a multiple of 8, at most 128; T a multiple of 128 | mx.fast.scaled_dot_product_attention (cuDNN's fused forward and backward) | B=1 Hq=32 Hkv=8 D=128 causal: T=2048 1.0 ms, 160 MB / 61 ms, 210 MB; T=8192 6.9 ms, 640 MB / 832 ms, 841 MB |
# | cuda | linear_cross_entropy | N x V at most 2**28 (1 GiB of fp32 logits) | the logits built (the reference form) | N=4096 V=32768 D=2048: 4.0 ms, 2.3 GB / 19.8 ms, 2.7 GB (at N=4096 V=152064: 17 ms, 10.6 GB / 125 ms, 4.5 GB: the kernels kept) |
#
# The conditions on attention are those under which MLX's CUDA backend runs cuDNN both ways: it
# takes 16-bit inputs and head sizes up to 128 in steps of 8, and its backward falls back to the
# full [T, T] scores when T is not a multiple of 128. Packed rows (segments) and head dim 64 were
# not timed (the run's budget ran out): they keep the kernels until measured.
MLX_WINS = {
    "cuda": {
        "attention": lambda q, segment_ids: (
            segment_ids is None
            and q.dtype in (mx.bfloat16, mx.float16)
            and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 128
            and q.shape[2] % 128 == 0
        ),
        "linear_cross_entropy": lambda n, v: n * v <= 1 << 28,
    },
}


def mlx_wins(backend: str, op: str, *shape) -> bool:
    """Whether ``MLX_WINS`` hands this call of ``op`` on ``backend`` to MLX's own operation."""
    rule = MLX_WINS.get(backend, {}).get(op)
    return rule is not None and bool(rule(*shape))


# launch(kernel, inputs, output_shapes, groups (x, y), threads per group, consts) -> outputs;
# a launcher also names the backend it runs on, ``launch.backend`` (see MLX_WINS)
Launcher = Callable[[Kernel, list, list, tuple, int, dict], list]


class FastLauncher:
    """Runs kernels through ``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel``."""

    def __init__(self, backend: str):
        if backend not in ("metal", "cuda"):
            raise ValueError(f"backend must be 'metal' or 'cuda', not {backend!r}")
        self.backend = backend
        self._kernels: dict[str, object] = {}

    def _kernel(self, kernel: Kernel):
        if kernel.name not in self._kernels:
            make = mx.fast.metal_kernel if self.backend == "metal" else mx.fast.cuda_kernel
            self._kernels[kernel.name] = make(
                name=f"mlxtune_{kernel.name}",
                input_names=list(kernel.inputs),
                output_names=list(kernel.outputs),
                source=source(kernel, self.backend),
                header=header(self.backend),
                ensure_row_contiguous=True,
            )
        return self._kernels[kernel.name]

    def __call__(self, kernel, inputs, outputs, groups, threads, consts):
        return self._kernel(kernel)(
            inputs=inputs,
            template=list(consts.items()),
            grid=(groups[0] * threads, groups[1], 1),
            threadgroup=(threads, 1, 1),
            output_shapes=outputs,
            output_dtypes=[mx.float32] * len(outputs),
        )


class EmulatedLauncher:
    """Runs kernels on the CPU emulator: for tests. Not traceable by ``mx.compile`` (it reads
    its inputs on the host). ``launches`` counts the kernels run, by name. ``backend`` is the
    backend it stands in for ("emulate": none, so ``MLX_WINS`` hands nothing to MLX)."""

    def __init__(self, seed: int = 0, backend: str = "emulate"):
        self.seed = seed
        self.backend = backend
        self.launches: dict[str, int] = {}

    def __call__(self, kernel, inputs, outputs, groups, threads, consts):
        from ..metal_kernels import emulate

        arrays = []
        for a in inputs:
            kind = np.int32 if mx.issubdtype(a.dtype, mx.integer) else np.float32
            arrays.append(np.array(a.astype(mx.float32 if kind is np.float32 else mx.int32)))
        outs, _ = emulate.run(kernel, arrays, outputs, groups, threads, consts, seed=self.seed)
        self.launches[kernel.name] = self.launches.get(kernel.name, 0) + 1
        return [mx.array(o) for o in outs]


def make_linear_cross_entropy(launch: Launcher):
    """The linear_cross_entropy tier whose per-chunk work runs through ``launch`` (and whose
    ``backend`` picks the shapes ``MLX_WINS`` hands to the logits built whole; an explicit
    ``chunk`` always runs the kernels)."""

    def linear_cross_entropy_fused(
        hidden,
        weight,
        targets,
        ignore_index,
        label_smoothing,
        softcap,
        chunk=None,
        weight_grad=True,
    ):
        n, v = hidden.shape[0], weight.shape[0]
        if chunk is None and mlx_wins(launch.backend, "linear_cross_entropy", n, v):
            return linear_cross_entropy_reference(
                hidden, weight, targets, ignore_index, label_smoothing, softcap
            )
        c = chunk or chunk_size(n, v)
        valid = targets != ignore_index
        safe = mx.where(valid, targets, 0).astype(mx.int32)
        capped = softcap is not None
        consts = {"TG": LCE_THREADS, "SOFTCAP": capped}

        @mx.custom_function
        def losses_fn(h, w, t):
            state = mx.broadcast_to(mx.array([-1e30, 0.0, 0.0, 0.0]), (n, 4))
            prm = mx.array([softcap if capped else 1.0], dtype=mx.float32)
            starts = chunk_starts(v, c)  # offsets as arrays: one fused kernel for every chunk
            for k, start in enumerate(range(0, v, c)):
                # chunk k is computed only once chunk k-1 is folded in (one tile at a time)
                after = mx.depends(h, state) if start else h
                z = after @ w[start : start + c].T
                (state,) = launch(
                    LCE_FORWARD,
                    [z, t - starts[k], state, prm],
                    [(n, 4)],
                    (n, 1),
                    LCE_THREADS,
                    consts,
                )
            lse = state[:, 0] + mx.log(state[:, 1])
            losses = token_losses(lse, state[:, 2], state[:, 3], valid, label_smoothing, v)
            return losses, lse

        @losses_fn.vjp
        def losses_vjp(primals, cotangents, outputs):
            h, w, t = primals
            g = mx.where(valid, cotangents[0].astype(mx.float32), 0.0)
            lse = outputs[1]
            prm = mx.array(
                [softcap if capped else 1.0, 1.0 - label_smoothing, label_smoothing / v],
                dtype=mx.float32,
            )

            def chunk_grad(after, wc, start):
                width = wc.shape[0]
                (dz,) = launch(
                    LCE_BACKWARD,
                    [after @ wc.T, t - start, lse, g, prm],
                    [(n, width)],
                    (math.ceil(width / LCE_THREADS), n),
                    LCE_THREADS,
                    consts,
                )
                return dz

            # the gradient GEMMs in the inputs' dtype: fp32 accumulation, 16-bit operands
            dh, dw = backward_over_chunks(h, w, c, chunk_grad, weight_grad, h.dtype)
            return dh, dw, mx.zeros_like(t)

        losses, _ = losses_fn(hidden, weight, safe)
        return losses, valid

    return linear_cross_entropy_fused


def attention_supported(head_dim: int) -> bool:
    """Whether the attention kernels take this head size (else the chunked tier runs)."""
    return all(attention_block(head_dim, k) for k in (ATTN_FORWARD, ATTN_DQ, ATTN_DKV))


def make_attention(launch: Launcher):
    """The attention tier whose kernels run through ``launch`` (and whose ``backend`` picks the
    shapes ``MLX_WINS`` hands to MLX's fused attention)."""

    def attention_fused(q, k, v, scale, causal=True, segment_ids=None):
        b, hq, t, d = q.shape
        hkv = k.shape[1]
        if not attention_supported(d):
            return attention_chunked(q, k, v, scale, causal, segment_ids)
        if mlx_wins(launch.backend, "attention", q, segment_ids):
            return attention_native(q, k, v, scale, causal, segment_ids)
        seg = (
            mx.zeros((1,), dtype=mx.int32) if segment_ids is None else segment_ids.astype(mx.int32)
        )
        prm = mx.array([scale], dtype=mx.float32)

        def run(kernel, inputs, outputs, heads):
            bq = attention_block(d, kernel)
            consts = {"DH": d, "BQ": bq, "CAUSAL": causal, "HAS_SEG": segment_ids is not None}
            return launch(kernel, inputs, outputs, (math.ceil(t / bq), heads), 4 * bq, consts)

        @mx.custom_function
        def attn(q, k, v):
            out, lse = run(ATTN_FORWARD, [q, k, v, seg, prm], [q.shape, (b, hq, t)], b * hq)
            return out.astype(q.dtype), lse

        @attn.vjp
        def attn_vjp(primals, cotangents, outputs):
            q, k, v = primals
            d_out = cotangents[0]
            out, lse = outputs
            delta = (d_out.astype(mx.float32) * out.astype(mx.float32)).sum(axis=-1)
            inputs = [q, k, v, d_out, lse, delta, seg, prm]
            (dq,) = run(ATTN_DQ, inputs, [q.shape], b * hq)
            dk, dv = run(ATTN_DKV, inputs, [k.shape, v.shape], b * hkv)
            return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

        return attn(q, k, v)[0]

    return attention_fused
