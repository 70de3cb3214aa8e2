"""Training the quantized model that ships (docs/quantization.md).

- Quantization-aware training (``train.qat``). ``fake_quantize(w, bits, group_size, mode)``
  is ``mx.dequantize(*mx.quantize(w, ...))`` in ``w``'s dtype: the values an MLX quantized
  checkpoint of that mode (affine: 2-8 bits with a scale and bias a group; mxfp4, nvfp4, mxfp8:
  MLX's floating-point formats) holds, bit for bit. Rounding has no useful derivative, so the
  backward is the straight-through estimator: the cotangent reaches the full-precision weight
  unchanged. ``install`` prepares the blocks' linear layers (a LoRA/DoRA layer's merged
  weight) to compute so inside ``quantizing()``; the engine enters it in its training and
  evaluation steps, and the exports write the codes of the same weights (``prepared``).
- Learned quantization (``objective.student_quantization``, as mlx-lm's DWQ): ``learn_scales``
  makes a quantized model's affine layers train their scales and biases through their
  de-quantized weights, the codes frozen.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .adapters import LoRALinear, LoRASwitchLinear, plain_layer
from .errors import UserInputError
from .models import VisionLM
from .models.common import derived_class
from .models.context import current, quantizing
from .models.quantize import is_quantized

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


# ---------------------------------------------------------------- the trained model's layers


@dataclass(frozen=True)
class Spec:
    """The format a QAT run trains against (``train.qat``)."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"

    def fake(self, w: mx.array) -> mx.array:
        """``w`` as this format stores it, the gradient straight through."""
        return _fake(self.bits, self.group_size, self.mode)(w)

    def describe(self) -> str:
        return f"{self.bits}-bit {self.mode} in groups of {self.group_size}"

    def as_dict(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "mode": self.mode}


def merged_weight(layer: nn.Module) -> mx.array:
    """The weight a prepared layer computes with: an adapter's base with the update merged in
    (what a fused export writes), or the layer's own weight."""
    merged = getattr(layer, "merged", None)
    return merged() if merged is not None else layer.weight


def _bias(layer: nn.Module):
    inner = layer.get("linear")
    return (inner if isinstance(inner, nn.Module) else layer).get("bias")


def _quantized_call(self, x, *args, **kwargs):
    """A prepared layer's call: its plain one, or inside ``quantizing()`` the same map with the
    (merged) weight fake-quantized."""
    plain = type(self)._mlxtune_qat_call
    if not current().quantized or getattr(self, "_disabled", 0):
        return plain(self, x, *args, **kwargs)
    # computed once the layer's input exists: MLX would otherwise quantize every layer's
    # weight first (they depend on parameters alone) and hold all the copies at once
    (w,) = mx.depends([merged_weight(self)], [x])
    w = self.qat_spec.fake(w)
    bias = _bias(self)
    if not self.qat_experts:
        y = x @ w.T
        return y + bias if bias is not None else y
    indices = args[0] if args else kwargs["indices"]
    sorted_indices = args[1] if len(args) > 1 else kwargs.get("sorted_indices", False)
    y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
    return y + mx.expand_dims(bias[indices], -2) if bias is not None else y


_PREPARED: dict[type, type] = {}


def _prepared_class(cls: type) -> type:
    if getattr(cls, "_mlxtune_qat_call", None) is not None:
        return cls
    doc = f"{cls.__name__} that computes with its weight fake-quantized in qat.quantizing()."
    return derived_class(
        cls, _PREPARED, "QAT", doc, __call__=_quantized_call, _mlxtune_qat_call=cls.__call__
    )


def is_prepared(m: nn.Module) -> bool:
    """Whether ``install`` prepared this layer."""
    return getattr(type(m), "_mlxtune_qat_call", None) is not None


def prepared(model: nn.Module) -> list[str]:
    """The paths of the layers ``install`` prepared: what a quantized export quantizes."""
    return [p for p, m in model.named_modules() if is_prepared(m)]


def install_layer(m: nn.Module, spec: Spec) -> None:
    """Prepare one linear layer (dense, experts, or LoRA/DoRA over one) to compute inside
    ``quantizing()`` with its (merged) weight as ``spec`` stores it: the instance's class
    becomes a subclass of its own, nothing else changes."""
    m.__class__ = _prepared_class(type(m))
    m.qat_spec = spec
    m.qat_experts = isinstance(m, (SwitchLinear, LoRASwitchLinear))


def install(model: nn.Module, spec: Spec) -> dict:
    """Prepare every linear layer of the transformer blocks (dense, experts, or LoRA/DoRA over
    one: then the merged weight) to compute, inside ``quantizing()``, with its weight as
    ``spec`` stores it. Only the instances change (each gets a subclass of its own class);
    names, values and what trains stay as they are, and outside ``quantizing()`` they compute
    as before. The embedding and the head stay in full precision (a quantized export leaves
    them so). Layers a family keeps out of quantization (mlx-lm's ``quant_predicate``) and
    layers quantized already (QLoRA's frozen base) are left as they are.

    Returns ``layers`` (prepared paths) and ``kept`` (paths left out, with why). Raises
    ValueError naming a layer whose width is not whole groups."""
    inside = {id(m) for b in getattr(model, "layers", []) for _, m in b.named_modules()}
    own = getattr(model, "quant_predicate", None)
    layers: list[str] = []
    kept: dict[str, str] = {}
    skip: set[int] = set()
    for path, m in model.named_modules():
        if id(m) not in inside or id(m) in skip:
            continue
        adapter = isinstance(m, LoRALinear)
        if adapter:
            skip.update(id(c) for _, c in m.named_modules())
        elif is_quantized(m):  # (the CPU's de-quantizing layers among them)
            kept[path] = "quantized already"
            continue
        elif not (isinstance(m, (nn.Linear, SwitchLinear)) and plain_layer(m)):
            continue
        if own is not None and own(path, m) is not True:
            kept[path] = "the family keeps it out of quantization"
            continue
        width = merged_weight(m).shape[-1]  # (a lazy graph: its shape, nothing computed)
        why = check(spec.bits, spec.group_size, spec.mode, width)
        if why is not None:
            raise ValueError(f"{path}: {why}")
        install_layer(m, spec)
        layers.append(path)
    return {"layers": layers, "kept": kept}


def prepare(model: nn.Module, q, log=None) -> Spec:
    """train.qat: the blocks' linear layers prepared to compute with their (merged) weights
    fake-quantized (``install``), refused by key where it cannot be; returns the format.
    ``q``: the recipe's ``train.qat`` (bits, group_size, mode, start_step)."""
    if isinstance(model, VisionLM):
        raise UserInputError(
            "quantization-aware training of vision-language models is not written yet; "
            "train a text model, or leave train.qat out",
            "train.qat",
        )
    spec = Spec(q.bits, q.group_size, q.mode)
    try:
        done = install(model, spec)
    except ValueError as e:
        raise UserInputError(
            f"{e}; choose a group_size that divides it", "train.qat.group_size"
        ) from None
    if not done["layers"]:
        raise UserInputError("the model's blocks hold no linear layer to quantize", "train.qat")
    if log is not None:
        kept = f"; {len(done['kept'])} left as they are" if done["kept"] else ""
        start = f" from step {q.start_step + 1}" if q.start_step else ""
        log(
            f"quantization-aware training{start}: {len(done['layers'])} linear layers of the "
            f"blocks compute with their weights as {spec.describe()} stores them (the "
            f"embedding and head stay in full precision){kept}"
        )
    return spec


# ---------------------------------------------------------------- learned quantization

LEARNED = "learned_quantization"
"""The adapter type a learned quantization's checkpoint records: what trains is the quantized
layers' scales and biases."""


def _dequantized(m: nn.Module, after: mx.array) -> mx.array:
    """A quantized layer's weight de-quantized (differentiably in its scales and biases), once
    ``after`` exists: not all layers' at the start of the step."""
    w, scales = mx.depends([m["weight"], m["scales"]], [after])
    return mx.dequantize(
        w, scales, m.get("biases"), m.group_size, m.bits, mode=getattr(m, "mode", "affine")
    )


def _learned_call(self, x, *args, **kwargs):
    """A quantized layer's map through its de-quantized weight, so that the loss's gradient
    reaches its scales and biases (the codes stay as they are)."""
    if isinstance(self, nn.QuantizedEmbedding):  # the rows of the tokens x holds
        return mx.dequantize(
            self["weight"][x], self["scales"][x], self["biases"][x], self.group_size, self.bits
        )
    w = _dequantized(self, x)
    if isinstance(self, QuantizedSwitchLinear):
        indices = args[0] if args else kwargs["indices"]
        sort = args[1] if len(args) > 1 else kwargs.get("sorted_indices", False)
        y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sort)
        return y + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else y
    y = x @ w.T.astype(x.dtype)
    return y + self["bias"] if "bias" in self else y


def _learned_as_linear(self, x):
    return x @ _dequantized(self, x).T.astype(x.dtype)


_LEARNED: dict[type, type] = {}


def _learned_class(cls: type) -> type:
    if getattr(cls, "_mlxtune_learned", False):
        return cls
    more = {"as_linear": _learned_as_linear} if issubclass(cls, nn.QuantizedEmbedding) else {}
    doc = f"{cls.__name__} whose scales and biases learn."
    return derived_class(
        cls, _LEARNED, "Learned", doc, __call__=_learned_call, _mlxtune_learned=True, **more
    )


def is_learned(m: nn.Module) -> bool:
    """Whether ``learn_scales`` made this layer's scales and biases train."""
    return bool(getattr(type(m), "_mlxtune_learned", False))


def learn_scales(model: nn.Module) -> dict:
    """Learned quantization (as mlx-lm's DWQ): every affine-quantized layer of ``model`` trains
    its scales and biases, through its de-quantized weight; everything else, the codes
    included, is frozen. Returns ``adapted`` (the layers' paths) and ``layers`` (None)."""
    model.freeze()
    adapted = []
    for path, m in model.named_modules():
        if is_quantized(m) and getattr(m, "mode", "affine") == "affine":
            m.__class__ = _learned_class(type(m))
            m.unfreeze(keys=["scales", "biases"], recurse=False)
            adapted.append(path)
    return {"adapted": adapted, "layers": None}


__all__ = [
    "LEARNED",
    "MODES",
    "Spec",
    "check",
    "fake_quantize",
    "install",
    "install_layer",
    "is_learned",
    "is_prepared",
    "learn_scales",
    "merged_weight",
    "prepare",
    "prepared",
    "quantizing",
]
