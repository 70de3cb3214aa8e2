"""QLoRA's quantized base: quantizing a model, reading a possibly quantized layer's weight, and
quantized layers that run at BLAS speed on the CPU.

MLX's CPU backend multiplies by a quantized matrix one element at a time (about 1 GFLOP/s on an
x86 core, against 50-180 for a dense fp32 matmul through OpenBLAS), which makes a QLoRA step over
a quantized base 20-40x slower than over a dense one. De-quantizing a layer's weight costs about
as much as reading it, so on the CPU ``cpu_dequantizing`` gives each quantized linear layer a
forward that de-quantizes its weight and multiplies densely, with a VJP that de-quantizes again
instead of keeping the dense weight from the forward pass: one layer's dense weight is alive at a
time, and the base stays quantized in memory. On a GPU MLX's own quantized kernels run.

A product over a few rows (a probe, a generated token) takes MLX's own quantized product
instead: there the dense weight would cost more than the product, in time and in memory (MLX's
de-quantization of a whole matrix peaks at twice its dense size on the CPU: 4.2 GB for an 8B
model's 128k x 4096 head, which the model probe multiplied six tokens by). A product over many
rows by a matrix as large as a head (a prompt's prefill in generation) de-quantizes it a block
of rows at a time (``WHOLE_ELEMENTS``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from ..errors import UserInputError


def is_quantized(m: nn.Module) -> bool:
    """Whether a layer is one of MLX's quantized linear or embedding layers, or mlx-lm's
    quantized experts."""
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))


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


def quantize_model(
    model: nn.Module, bits: int = 4, group_size: int = 64, evaluate: bool = True
) -> dict:
    """Quantize a model's base in place for QLoRA: every dense Linear and Embedding whose input
    size is a multiple of ``group_size`` becomes its MLX quantized twin (affine, ``bits`` per
    weight, one scale and bias per group), as mlx-lm's convert does; the tied LM head goes with
    the embedding. Layers that are quantized already stay as they are.

    Returns a summary: ``layers`` (how many were quantized), ``skipped`` (paths whose shapes do
    not allow it), ``already`` (layers quantized before), ``bytes_before`` / ``bytes_after``
    (every weight of the model, as held). ``evaluate``: False leaves the new codes lazy (an
    export computes them as it writes each shard, never the whole model at once).
    """
    bytes_before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    already = sum(1 for _, m in model.named_modules() if is_quantized(m))
    own = getattr(model, "quant_predicate", None)  # a family's own exclusions (mlx-lm's hook)
    quantized: list[str] = []
    skipped: list[str] = []

    def predicate(path: str, m: nn.Module):
        if not isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear)):
            return False
        if not hasattr(m, "to_quantized"):
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
    if evaluate:
        materialize(model)
    cpu_dequantizing(model)
    return {
        "bits": bits,
        "group_size": group_size,
        "layers": len(quantized),
        "skipped": skipped,
        "already": already,
        "bytes_before": bytes_before,
        "bytes_after": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    }


def materialize(model: nn.Module) -> None:
    """Compute ``model``'s lazy weights one layer at a time: a weight computed from another (a
    layer quantized from a dense one just read, a cast) holds only its layer's source at once,
    where evaluating every weight together lets MLX compute all the sources first."""
    for _, m in model.named_modules():
        own = [v for k, v in m.items() if isinstance(v, mx.array)]
        if own:
            mx.eval(own)
    mx.eval(model.parameters())  # any weight held outside a module's own keys


def _dense_after(group_size: int, bits: int, mode: str):
    """dense(w, scales, biases, after): the de-quantized weight, computed only once ``after``
    exists: MLX may otherwise run every layer's de-quantization early (they depend on
    parameters alone) and hold them all at once."""

    def dense(w, scales, biases, after):
        w, scales = mx.depends([w, scales], [after])
        return mx.dequantize(w, scales, biases, group_size, bits, mode=mode)

    return dense


# A product over many rows de-quantizes a weight of up to WHOLE_ELEMENTS at once (every
# layer of an 8B model but its head); a larger one (an LM head, 128k x 4096 = 525M: 2.1 GB
# dense in fp32, twice that while MLX de-quantizes it on the CPU) a block of BLOCK_ELEMENTS
# at a time, each block once the product before it is done. MLX's CPU backend allocates a
# block's buffers as it queues it, up to two blocks ahead of the one computing: small blocks
# keep that lead small (measured over a 64k x 1024 head: 2 blocks of 32M peaked as high as
# the whole matrix, 16 of 4M at a fifth of it).
WHOLE_ELEMENTS = 1 << 26
BLOCK_ELEMENTS = 1 << 22


def _row_blocks(out_rows: int, in_features: int) -> list[tuple[int, int]]:
    if out_rows * in_features <= WHOLE_ELEMENTS:
        return [(0, out_rows)]
    step = max(1, BLOCK_ELEMENTS // max(in_features, 1))
    return [(i, min(i + step, out_rows)) for i in range(0, out_rows, step)]


def _rows(dense, w, scales, biases, block: tuple[int, int], after):
    """Rows [i, j) of a quantized weight de-quantized by ``dense`` (``_dense_after``), once
    ``after`` exists."""
    i, j = block
    return dense(w[i:j], scales[i:j], None if biases is None else biases[i:j], after)


def dequantized_rows(m: nn.Module, dtype=None) -> list[mx.array] | None:
    """A quantized linear or embedding layer's weight de-quantized (and cast to ``dtype``) as
    blocks of rows, each computed once the one before is cast, lazily: what an export writes of
    a weight of more than WHOLE_ELEMENTS (an LM head), which de-quantized whole holds twice its
    fp32 size on the CPU. None for a smaller weight (de-quantized whole)."""
    rows, packed = m.weight.shape[0], m.weight.shape[-1]
    blocks = _row_blocks(rows, packed * 32 // m.bits)
    if len(blocks) == 1:
        return None
    dense = _dense_after(m.group_size, m.bits, getattr(m, "mode", "affine"))
    parts, after = [], m.scales
    for block in blocks:
        after = _rows(dense, m.weight, m.scales, m.get("biases"), block, after)
        if dtype is not None:
            after = after.astype(dtype)
        parts.append(after)
    return parts


def _dequantizing_matmul(group_size: int, bits: int, mode: str, has_biases: bool):
    """x @ dequantize(w).T as a function of (x, w, scales[, biases]) whose VJP de-quantizes w
    again (the frozen base gets no gradient). A weight of more than ``WHOLE_ELEMENTS`` goes a
    block of output rows at a time, each block de-quantized once the one before is done."""
    key = (group_size, bits, mode, has_biases)
    if key in _MATMULS:
        return _MATMULS[key]
    dense = _dense_after(group_size, bits, mode)

    def rows(w, scales, biases, block, after):
        return _rows(dense, w, scales, biases, block, after)

    @mx.custom_function
    def f(x, w, scales, *biases):
        b = biases[0] if biases else None
        blocks = _row_blocks(w.shape[0], x.shape[-1])
        if len(blocks) == 1:
            return x @ dense(w, scales, b, x).astype(x.dtype).T
        outs, after = [], x
        for block in blocks:
            after = x @ rows(w, scales, b, block, after).astype(x.dtype).T
            outs.append(after)
        return mx.concatenate(outs, axis=-1)

    @f.vjp
    def f_vjp(primals, cotangent, _):
        x, w, scales, *biases = primals
        b = biases[0] if biases else None
        dx = None
        for i, j in _row_blocks(w.shape[0], x.shape[-1]):
            d = rows(w, scales, b, (i, j), cotangent if dx is None else dx)
            part = cotangent[..., i:j] @ d.astype(cotangent.dtype)
            dx = part if dx is None else dx + part
        return (dx, mx.zeros_like(w), mx.zeros_like(scales), *(mx.zeros_like(b) for b in biases))

    _MATMULS[key] = f
    return f


_MATMULS: dict = {}


# at most this many rows of input: MLX's own quantized product (about 1 GFLOP/s on the CPU: 3 s
# for 16 rows by a 128k x 2048 head, which de-quantizing takes a third of)
FEW_ROWS = 16


def _own_product(x: mx.array) -> bool:
    """Whether ``x`` times a quantized weight goes to MLX's quantized product (see above)."""
    return x.size // max(x.shape[-1], 1) <= FEW_ROWS


class DequantizingLinear(nn.QuantizedLinear):
    """A ``QuantizedLinear`` that multiplies by its de-quantized weight (see the module's
    docstring); the same parameters, so it saves, loads and fuses as its parent does."""

    def __call__(self, x):
        if _own_product(x):
            return super().__call__(x)
        biases = (self["biases"],) if "biases" in self else ()
        f = _dequantizing_matmul(
            self.group_size, self.bits, getattr(self, "mode", "affine"), bool(biases)
        )
        y = f(x, self["weight"], self["scales"], *biases)
        return y + self["bias"] if "bias" in self else y


def _dequantizing_gather(group_size: int, bits: int, mode: str, has_biases: bool, sort: bool):
    """``gather_mm(x, dequantize(w) transposed, indices)`` (each token times the experts it is
    routed to) whose VJP de-quantizes w again, as ``_dequantizing_matmul`` does for one matrix."""
    key = ("gather", group_size, bits, mode, has_biases, sort)
    if key in _MATMULS:
        return _MATMULS[key]
    dense = _dense_after(group_size, bits, mode)

    @mx.custom_function
    def f(x, indices, w, scales, *biases):
        d = dense(w, scales, biases[0] if biases else None, x).astype(x.dtype)
        return mx.gather_mm(x, d.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sort)

    @f.vjp
    def f_vjp(primals, cotangent, _):
        x, indices, w, scales, *biases = primals
        b = biases[0] if biases else None
        d = dense(w, scales, b, cotangent).astype(cotangent.dtype)
        dx = mx.gather_mm(cotangent, d, rhs_indices=indices, sorted_indices=sort)
        # x was broadcast against the experts a token is routed to: sum those copies back
        lead = dx.ndim - x.ndim
        if lead:
            dx = dx.sum(axis=tuple(range(lead)))
        axes = tuple(i for i, n in enumerate(x.shape) if n == 1 and dx.shape[i] != 1)
        if axes:
            dx = dx.sum(axis=axes, keepdims=True)
        zeros = (mx.zeros_like(indices), mx.zeros_like(w), mx.zeros_like(scales))
        return (dx, *zeros, *(mx.zeros_like(v) for v in biases))

    _MATMULS[key] = f
    return f


class DequantizingSwitchLinear(QuantizedSwitchLinear):
    """A ``QuantizedSwitchLinear`` (a mixture's quantized experts) that multiplies by its
    de-quantized weight through BLAS on the CPU, as ``DequantizingLinear`` does; the same
    parameters."""

    def __call__(self, x, indices, sorted_indices=False):
        biases = (self["biases"],) if self.get("biases") is not None else ()
        f = _dequantizing_gather(
            self.group_size, self.bits, self.mode, bool(biases), sorted_indices
        )
        y = f(x, indices, self["weight"], self["scales"], *biases)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


class DequantizingEmbedding(nn.QuantizedEmbedding):
    """A ``QuantizedEmbedding`` whose tied-head use (``as_linear``) multiplies densely."""

    def as_linear(self, x):
        if _own_product(x):
            return super().as_linear(x)
        biases = (self["biases"],) if "biases" in self else ()
        f = _dequantizing_matmul(
            self.group_size, self.bits, getattr(self, "mode", "affine"), bool(biases)
        )
        return f(x, self["weight"], self["scales"], *biases)


def cpu_dequantizing(model: nn.Module) -> int:
    """On the CPU, turn every quantized linear/embedding layer of ``model`` into its
    de-quantizing twin (in place, same parameters); the number of layers changed. Nothing on a
    GPU."""
    if mx.default_device().type == mx.DeviceType.gpu:
        return 0
    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedLinear and getattr(m, "mode", "affine") == "affine":
            m.__class__ = DequantizingLinear
            n += 1
        elif type(m) is nn.QuantizedEmbedding and getattr(m, "mode", "affine") == "affine":
            m.__class__ = DequantizingEmbedding
            n += 1
        elif (
            type(m) is QuantizedSwitchLinear
            and m.mode == "affine"
            and getattr(m, "global_scale", None) is None
        ):
            m.__class__ = DequantizingSwitchLinear
            n += 1
    return n


def _dequantizable(m: nn.Module) -> bool:
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))


def dequantize_for_training(model: nn.Module) -> tuple[int, list[str]]:
    """De-quantize the model's quantized linear, embedding and experts' layers in place (a full
    fine-tune trains every weight, and quantized codes have no gradient): (how many, the paths
    of quantized layers of other kinds left, which cannot be de-quantized here)."""
    from mlx_lm.utils import dequantize_model

    plain = sum(1 for _, m in model.named_modules() if _dequantizable(m))
    if plain:
        dequantize_model(model)
    left = [p for p, m in model.named_modules() if isinstance(m.get("scales"), mx.array)]
    return plain, left
