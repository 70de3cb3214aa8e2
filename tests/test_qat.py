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


@pytest.mark.parametrize(
    "mode, group", [("affine", 32), ("affine", 64), ("affine", 128), ("mxfp4", 32), ("nvfp4", 16)]
)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gguf_blocks_hold_the_codes_mlx_quantize_gives(mode, group, dtype):
    """A QAT run's GGUF blocks, read back by the gguf package (llama.cpp's reader): MXFP4 and
    NVFP4 the fake-quantized values exactly; Q4_1 each MLX group's codes with its scale and
    bias in fp16 (value = q x fp16(scale) + fp16(bias), the codes unpacked here from MLX's
    uint32 words)."""
    import gguf

    from mlxtune.export.gguf.codes import CodesError, encode

    w = (mx.random.normal((8, 256), key=mx.random.key(4)) * 0.05).astype(dtype)
    spec = {"bits": 4, "group_size": group, "mode": mode}
    data, kind = encode(np.array(w.astype(mx.float32)), spec, dtype)
    back = gguf.quants.dequantize(data, kind)
    if mode != "affine":
        want = fake_quantize(w, 4, group, mode).astype(mx.float32)
        np.testing.assert_array_equal(back, np.array(want))
    else:
        q, s, b = mx.quantize(w, group_size=group, bits=4)
        words = np.array(q).astype(np.uint32)
        codes = (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF
        codes = codes.reshape(8, 256 // group, group).astype(np.float32)
        s16 = np.array(s.astype(mx.float32)).astype(np.float16).astype(np.float32)[..., None]
        b16 = np.array(b.astype(mx.float32)).astype(np.float16).astype(np.float32)[..., None]
        np.testing.assert_allclose(back, (codes * s16 + b16).reshape(8, 256), rtol=1e-6, atol=1e-7)
    if mode == "nvfp4":
        with pytest.raises(CodesError, match="64 weights a block"):
            encode(np.zeros((2, 32), np.float32), spec, dtype)
