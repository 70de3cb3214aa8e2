"""Quantization-aware training's fake quantization (``mlxtune.qat``): the values MLX's
quantize-then-dequantize gives, bit for bit, for every format, and the straight-through
gradient, against NumPy."""

import mlx.core as mx
import numpy as np
import pytest

from mlxtune.qat import MODES, check, fake_quantize

CASES = [("affine", b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64)] + [
    ("mxfp4", 4, 32),
    ("nvfp4", 4, 16),
    ("mxfp8", 8, 32),
]


@pytest.mark.parametrize("mode,bits,group", CASES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fake_quantization_is_mlx_quantize_then_dequantize_bit_for_bit(mode, bits, group, dtype):
    w = (mx.random.normal((16, 128), key=mx.random.key(bits + group)) * 0.3).astype(dtype)
    parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    biases = parts[2] if mode == "affine" else None
    want = mx.dequantize(parts[0], parts[1], biases, group_size=group, bits=bits, mode=mode)
    got = fake_quantize(w, bits, group, mode)
    assert got.dtype == dtype and got.shape == w.shape
    np.testing.assert_array_equal(
        np.array(got.astype(mx.float32)), np.array(want.astype(dtype).astype(mx.float32))
    )
    # and it quantizes: not the weight itself, within the format's step of it
    assert not mx.array_equal(got, w).item()


@pytest.mark.parametrize("mode,bits,group", [CASES[2], CASES[-3], CASES[-1]])
def test_the_gradient_passes_straight_through(mode, bits, group):
    w = mx.random.normal((8, 64), key=mx.random.key(1))
    c = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    grad = mx.grad(lambda w: (fake_quantize(w, bits, group, mode) * mx.array(c)).sum())(w)
    np.testing.assert_array_equal(np.array(grad), c)  # d/dw of sum(q(w) * c), q' taken as 1


def test_what_cannot_be_quantized_is_said():
    assert "mode must be one of" in check(4, 64, "int4")
    assert "affine takes bits" in check(7, 64, "affine")
    assert "nvfp4 takes group_size 16" in check(4, 32, "nvfp4")
    assert "not a whole number of groups of 64" in check(4, 64, "affine", 96)
    assert all(check(b, g, m) is None for m, (bs, gs) in MODES.items() for b in bs for g in gs)
    with pytest.raises(ValueError, match="groups of 64"):
        fake_quantize(mx.zeros((2, 96)), 4, 64)
