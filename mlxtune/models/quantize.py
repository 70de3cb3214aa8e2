"""QLoRA's quantized base: quantizing a model, and reading a possibly quantized layer's weight."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserInputError


def is_quantized(m: nn.Module) -> bool:
    """Whether a layer is one of MLX's quantized linear or embedding layers."""
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def dense_weight(m: nn.Module) -> mx.array:
    """A linear or embedding layer's [out, in] weight, de-quantized when the layer is quantized."""
    if not is_quantized(m):
        return m.weight
    return mx.dequantize(
        m.weight,
        m.scales,
        m.get("biases"),
        m.group_size,
        m.bits,
        mode=getattr(m, "mode", "affine"),
    )


def quantize_model(model: nn.Module, bits: int = 4, group_size: int = 64) -> dict:
    """Quantize a model's base in place for QLoRA: every dense Linear and Embedding whose input
    size is a multiple of ``group_size`` becomes its MLX quantized twin (affine, ``bits`` per
    weight, one scale and bias per group), as mlx-lm's convert does; the tied LM head goes with
    the embedding. Layers that are quantized already stay as they are.

    Returns a summary: ``layers`` (how many were quantized), ``skipped`` (paths whose shapes do
    not allow it), ``already`` (layers quantized before), ``bytes_before`` / ``bytes_after``
    (every weight of the model, as held).
    """
    bytes_before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    already = sum(1 for _, m in model.named_modules() if is_quantized(m))
    own = getattr(model, "quant_predicate", None)  # a family's own exclusions (mlx-lm's hook)
    quantized: list[str] = []
    skipped: list[str] = []

    def predicate(path: str, m: nn.Module):
        if not isinstance(m, (nn.Linear, nn.Embedding)) or not hasattr(m, "to_quantized"):
            return False
        if m.weight.shape[-1] % group_size:
            skipped.append(path)
            return False
        choice = own(path, m) if own is not None else True
        if choice:
            quantized.append(path)
        return choice

    try:
        nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    except ValueError as e:
        raise UserInputError(
            f"cannot quantize to {bits} bits in groups of {group_size}: {e}", "model.quantize"
        ) from None
    mx.eval(model.parameters())
    return {
        "bits": bits,
        "group_size": group_size,
        "layers": len(quantized),
        "skipped": skipped,
        "already": already,
        "bytes_before": bytes_before,
        "bytes_after": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    }
