"""LoRA and DoRA layers, putting them into a model by layer name and layer range, and turning
them off for a while (the base model as a frozen reference, at no extra memory).

Parameter names and orientation follow mlx-lm (``lora_a`` [in, r], ``lora_b`` [r, out]), so an
adapter file mlxtune writes is an mlx-lm adapter file.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from .errors import UserInputError
from .models.context import current, dropout_key
from .models.quantize import dense_weight

__all__ = [
    "DoRALinear",
    "LoRALinear",
    "adapters_disabled",
    "apply_adapters",
    "dropout_key",
    "lora_scale",
    "select_layers",
]


def _base_dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or QuantizedLinear."""
    out_dims, in_dims = base.weight.shape
    if isinstance(base, nn.QuantizedLinear):
        in_dims = in_dims * 32 // base.bits
    return in_dims, out_dims


def _dropout(layer: nn.Dropout, x: mx.array) -> mx.array:
    """``layer(x)``, with the mask from the active dropout_key when there is one."""
    keys = current().dropout_keys
    if keys is None or not layer.training or layer._p_1 == 1:
        return layer(x)
    sub = keys.next()
    mask = mx.random.bernoulli(layer._p_1, x.shape, key=sub)
    return (mask * x) * (1 / layer._p_1)


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """What LoRA's update is multiplied by: alpha / rank, or alpha / sqrt(rank) (rsLoRA: the
    update's size then stays put as the rank grows)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


class LoRALinear(nn.Module):
    """y = base(x) + scale * dropout(x) @ A @ B, with A random and B zero (so y starts = base(x))."""

    @classmethod
    def from_base(
        cls,
        base: nn.Module,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        rslora: bool = False,
    ):
        in_dims, out_dims = _base_dims(base)
        layer = cls(in_dims, out_dims, rank, alpha, dropout, rslora)
        layer.linear = base
        return layer

    def __init__(
        self,
        in_dims: int,
        out_dims: int,
        rank: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        rslora: bool = False,
    ):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        self.dropout = nn.Dropout(p=dropout)
        self.scale = lora_scale(alpha, rank, rslora)
        bound = 1.0 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(low=-bound, high=bound, shape=(in_dims, rank))
        self.lora_b = mx.zeros((rank, out_dims))

    # how many adapters_disabled blocks around this layer are open (0: the adapter is on)
    _disabled = 0

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        y = self.linear(x)
        z = (_dropout(self.dropout, x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        return y + (self.scale * z).astype(y.dtype)

    def delta(self) -> mx.array:
        """The update to the base weight, [out, in]."""
        return self.scale * (self.lora_b.T @ self.lora_a.T)

    def fused(self) -> nn.Linear:
        """A plain Linear with the adapter merged in (de-quantized when the base was quantized)."""
        w = dense_weight(self.linear)
        fused = nn.Linear(w.shape[1], w.shape[0], bias="bias" in self.linear)
        fused.weight = (w.astype(mx.float32) + self.delta()).astype(w.dtype)
        if "bias" in self.linear:
            fused.bias = self.linear.bias
        return fused


class DoRALinear(LoRALinear):
    """Weight-decomposed LoRA: y = m * (W + dW) x / ||W + dW||_row, m starting at ||W||_row."""

    @classmethod
    def from_base(cls, base: nn.Module, *args, **kw):
        """LoRALinear.from_base's layer, with the magnitude m = ||W||_row."""
        layer = super().from_base(base, *args, **kw)
        layer.m = mx.linalg.norm(dense_weight(base).astype(mx.float32), axis=1)
        return layer

    def __call__(self, x):
        if self._disabled:
            return self.linear(x)
        w = dense_weight(self.linear)
        y = x @ w.T
        z = (_dropout(self.dropout, x) @ self.lora_a.astype(x.dtype)) @ self.lora_b.astype(x.dtype)
        out = y + (self.scale * z).astype(y.dtype)
        adapted = w.astype(mx.float32) + self.delta()
        out = out * (self.m / mx.linalg.norm(adapted, axis=1)).astype(out.dtype)
        if "bias" in self.linear:
            out = out + self.linear.bias
        return out

    def fused(self) -> nn.Linear:
        w = dense_weight(self.linear)
        adapted = w.astype(mx.float32) + self.delta()
        adapted = adapted * (self.m / mx.linalg.norm(adapted, axis=1))[:, None]
        fused = nn.Linear(w.shape[1], w.shape[0], bias="bias" in self.linear)
        fused.weight = adapted.astype(w.dtype)
        if "bias" in self.linear:
            fused.bias = self.linear.bias
        return fused


def select_layers(n_layers: int, spec) -> list[int]:
    """Layer indices from the recipe's adapter.layers: None/all, N (last N), "a-b", or a list."""
    if spec is None or spec == "all":
        return list(range(n_layers))
    if isinstance(spec, int):
        if spec > n_layers:
            raise UserInputError(
                f"the model has {n_layers} layers, cannot adapt the last {spec}", "adapter.layers"
            )
        return list(range(n_layers - spec, n_layers))
    if isinstance(spec, str):
        a, b = (int(x) for x in spec.split("-"))
        idx = list(range(a, b + 1))
    else:
        idx = sorted(set(spec))
    bad = [i for i in idx if i >= n_layers]
    if bad:
        raise UserInputError(
            f"layer {bad[0]} does not exist (the model has {n_layers}: 0-{n_layers - 1})",
            "adapter.layers",
        )
    return idx


def apply_adapters(
    model: nn.Module,
    kind: str,
    rank: int,
    alpha: float,
    dropout: float,
    targets,
    layers=None,
    rslora: bool = False,
) -> dict:
    """Freeze the base and put adapters in; for "full", everything trains. Returns a summary."""
    if kind == "full":
        model.unfreeze()
        return {"type": "full", "adapted": []}
    cls = DoRALinear if kind == "dora" else LoRALinear
    model.freeze()
    blocks = model.layers
    chosen = select_layers(len(blocks), layers)
    all_linear = "all-linear" in targets
    adapted = []
    seen_names = set()
    for i in chosen:
        block = blocks[i]
        replace = []
        for name, mod in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            seen_names.add(leaf)
            if not isinstance(mod, (nn.Linear, nn.QuantizedLinear)):
                continue
            if all_linear or leaf in targets:
                layer = cls.from_base(mod, rank, alpha, dropout, rslora)
                replace.append((name, layer))
        if replace:
            block.update_modules(tree_unflatten(replace))
            adapted += [f"layers.{i}.{n}" for n, _ in replace]
    if not all_linear:
        missing = [t for t in targets if t not in seen_names]
        if missing:
            linear_names = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in blocks[0].named_modules()
                    if isinstance(m, (nn.Linear, nn.QuantizedLinear))
                }
            )
            raise UserInputError(
                f"no layer named {missing[0]!r} in this model; its linear layers are: {', '.join(linear_names)}",
                "adapter.targets",
            )
    if not adapted:
        raise UserInputError("no linear layer matched adapter.targets", "adapter.targets")
    return {"type": kind, "adapted": adapted, "layers": chosen}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every LoRA/DoRA layer of ``model`` computes its base layer alone (no
    adapter branch, no dropout, no DoRA magnitude): the model is its base, a frozen reference
    policy that costs no extra memory. Gradients of a loss computed inside the block with
    respect to the adapters are zero. The layers are restored on exit, also when the block
    raises, and blocks nest.

    It is Python state that each layer reads when it runs, so under ``mx.compile`` it is read
    at trace time: enter it inside the traced function. Entered around a call of a function
    compiled already, it changes nothing that function computes.
    """
    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m._disabled += 1
    try:
        yield model
    finally:
        for m in layers:
            m._disabled -= 1
