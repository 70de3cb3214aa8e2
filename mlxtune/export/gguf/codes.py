"""A quantization-aware run's codes in GGUF: the blocks llama.cpp reads, packed from the codes
MLX's ``quantize`` gives the trained weight (the codes QAT computed with), never quantized
again from the values.

- affine, 4 bits (any group size: each of llama.cpp's 32-weight blocks lies in one MLX group)
  -> ``Q4_1``: value = d x q + m, d and m the group's scale and bias stored in fp16 (exact for
  a 16-bit model's scales; a relative 2^-11 of rounding for an fp32 one's);
- mxfp4 -> ``MXFP4``: the same e8m0 scale and e2m1 codes, exactly;
- nvfp4 -> ``NVFP4``: the same e4m3 scales and e2m1 codes, exactly (widths a multiple of 64).

Other formats have no GGUF type that holds their codes (``refusal`` says why).
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np

from ...models.gguf.load import mlx_codes

_TYPES = {
    ("affine", 4): gguf.GGMLQuantizationType.Q4_1,
    ("mxfp4", 4): gguf.GGMLQuantizationType.MXFP4,
    ("nvfp4", 4): gguf.GGMLQuantizationType.NVFP4,
}
FILE_TYPES = {
    gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    gguf.GGMLQuantizationType.MXFP4: gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    gguf.GGMLQuantizationType.NVFP4: gguf.LlamaFileType.MOSTLY_NVFP4,
}
"""The file type a GGUF whose blocks' weights are of each type declares."""

_ROWS_ELEMENTS = 1 << 24
"""The most weights quantized and packed at once (a large weight goes a block of rows at a
time)."""


class CodesError(ValueError):
    """A weight the GGUF type of the trained codes cannot pack (its shape)."""


def gguf_type(spec: dict):
    """The GGUF type holding ``spec``'s codes (bits, group_size, mode), or None."""
    return _TYPES.get((spec["mode"], spec["bits"]))


def refusal(spec: dict) -> str | None:
    """Why a GGUF file cannot hold the codes a run trained toward (``spec``), or None."""
    if gguf_type(spec) is not None:
        return None
    if spec["mode"] == "affine":
        return (
            f"GGUF has no type that holds MLX's {spec['bits']}-bit affine codes as they are "
            "(Q4_1 holds 4-bit ones; llama.cpp's other types round differently): train with "
            "train.qat.bits 4, or export fused"
        )
    return (
        f"GGUF has no type for MLX's {spec['mode']} codes (MXFP4 and NVFP4 are llama.cpp's "
        "floating-point 4-bit types): train with mode mxfp4 or nvfp4, or export fused"
    )


def _halves(q: np.ndarray, size: int) -> np.ndarray:
    """Codes [rows, blocks, size] as llama.cpp packs a block's: byte j = code j | code
    j + size/2 << 4."""
    half = size // 2
    return q[..., :half] | (q[..., half:] << 4)


def _pack(w: mx.array, spec: dict) -> np.ndarray:
    bits, group, mode = spec["bits"], spec["group_size"], spec["mode"]
    parts = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    rows, n = w.shape
    q = mlx_codes(np.array(parts[0]), 4)
    if mode == "affine":  # one Q4_1 block per 32 weights: the group's scale and bias, in fp16
        per = group // 32
        d = np.repeat(np.array(parts[1].astype(mx.float32)), per, axis=-1).astype(np.float16)
        m = np.repeat(np.array(parts[2].astype(mx.float32)), per, axis=-1).astype(np.float16)
        qs = _halves(q.reshape(rows, n // 32, 32), 32)
        blocks = np.concatenate(
            [d.view(np.uint8).reshape(rows, -1, 2), m.view(np.uint8).reshape(rows, -1, 2), qs],
            axis=-1,
        )
    elif mode == "mxfp4":  # e8m0 scale byte, then the 32 codes
        e = np.array(parts[1]).reshape(rows, n // 32, 1)
        blocks = np.concatenate([e, _halves(q.reshape(rows, n // 32, 32), 32)], axis=-1)
    else:  # nvfp4: 64 weights a block: 4 e4m3 scale bytes, then 4 x 16 codes
        s = np.array(parts[1]).reshape(rows, n // 64, 4)
        qs = _halves(q.reshape(rows, n // 64, 4, 16), 16).reshape(rows, n // 64, 32)
        blocks = np.concatenate([s, qs], axis=-1)
    return blocks.reshape(rows, -1)


def encode(a: np.ndarray, spec: dict, dtype) -> tuple[np.ndarray, object]:
    """(GGUF data, its type) of a trained weight ``a`` (fp32 NumPy, last axis the input, rows
    in any order: the codes are a row's own), quantized in ``dtype`` (the trained weights'
    MLX dtype, in which QAT quantized them)."""
    kind = gguf_type(spec)
    if kind is None:
        raise CodesError(refusal(spec))
    n = a.shape[-1]
    if spec["mode"] == "nvfp4" and n % 64:
        raise CodesError(f"NVFP4 packs 64 weights a block; a row of {n} is not whole blocks")
    flat = a.reshape(-1, n)
    step = max(1, _ROWS_ELEMENTS // n)
    data = np.concatenate(
        [_pack(mx.array(flat[i : i + step]).astype(dtype), spec) for i in range(0, len(flat), step)]
    )
    return data.reshape(*a.shape[:-1], -1), kind


__all__ = ["FILE_TYPES", "CodesError", "encode", "gguf_type", "refusal"]
