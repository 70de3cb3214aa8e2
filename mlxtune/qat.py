"""Quantization-aware training's core: weights quantized and de-quantized exactly as the
target format stores them, with the gradient passed straight through.

``fake_quantize(w, bits, group_size, mode)`` is ``mx.dequantize(*mx.quantize(w, ...))`` in
``w``'s dtype: the forward computes with the values an MLX quantized checkpoint of that mode
(affine: 2-8 bits with a scale and bias a group; mxfp4, nvfp4, mxfp8: MLX's floating-point
formats) will hold, bit for bit. Rounding has no useful derivative, so the backward is the
straight-through estimator: the cotangent reaches the full-precision weight unchanged.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

MODES = {
    # mode: (bits it allows, group sizes it allows)
    "affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128)),
    "mxfp4": ((4,), (32,)),
    "nvfp4": ((4,), (16,)),
    "mxfp8": ((8,), (32,)),
}
"""The formats MLX quantizes to, with the bits and group sizes each takes."""


def check(bits: int, group_size: int, mode: str, width: int | None = None) -> str | None:
    """Why ``bits``, ``group_size`` and ``mode`` cannot quantize a weight ``width`` wide (its
    last axis), or None."""
    if mode not in MODES:
        return f"mode must be one of {', '.join(MODES)}, got {mode!r}"
    allowed_bits, allowed_groups = MODES[mode]
    if bits not in allowed_bits:
        return f"{mode} takes bits {', '.join(map(str, allowed_bits))}, got {bits}"
    if group_size not in allowed_groups:
        return f"{mode} takes group_size {', '.join(map(str, allowed_groups))}, got {group_size}"
    if width is not None and width % group_size:
        return f"a weight {width} wide is not a whole number of groups of {group_size}"
    return None


@cache
def _fake(bits: int, group_size: int, mode: str):
    @mx.custom_function
    def f(w):
        parts = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
        scales_biases = parts[1:] if mode == "affine" else (parts[1], None)
        return mx.dequantize(
            parts[0], *scales_biases, group_size=group_size, bits=bits, mode=mode, dtype=w.dtype
        )

    @f.vjp
    def f_vjp(primals, cotangent, _):
        return cotangent  # straight through: rounding's derivative is taken as 1

    return f


def fake_quantize(w: mx.array, bits: int = 4, group_size: int = 64, mode: str = "affine"):
    """``w`` as the quantized format stores it (quantized, de-quantized, in ``w``'s dtype),
    its gradient passed straight through to ``w``."""
    why = check(bits, group_size, mode, w.shape[-1])
    if why is not None:
        raise ValueError(why)
    return _fake(bits, group_size, mode)(w)


__all__ = ["MODES", "check", "fake_quantize"]
