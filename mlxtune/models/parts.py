"""A model split into its backbone and LM head, so the loss never needs the full logits.

Any mlx-lm causal LM: the head is found by watching one short forward pass (the last linear map
onto the vocabulary, or the embedding used as one), and the hidden states are what the model
hands that head. What the model does to the head's output (a soft cap, a scale, a bias) is found
on the same pass and checked against the model's own logits, so the loss computes exactly the
model's logits; a model whose logits are something else is refused, naming what differs.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserInputError
from ..kernels.chunked import QuantizedRows
from .quantize import dense_weight, is_quantized

_LINEAR = (nn.Linear, nn.QuantizedLinear)
_EMBEDDING = (nn.Embedding, nn.QuantizedEmbedding)

# while a forward pass runs inside LMParts.hidden: where the head's input goes
_CAPTURE: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mlxtune_head_capture", default=None
)
# while the probe runs: every call of a candidate head or embedding, in order
_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "mlxtune_head_probe", default=None
)


def module_at(model: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path from ``named_modules`` (list entries by index)."""
    m = model
    for part in path.split(".") if path else ():
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def _vocab_out(x: mx.array, rows: int) -> mx.array:
    """A stand-in for the head's output that is never computed (nothing reads it)."""
    return mx.zeros((*x.shape[:-1], rows), x.dtype)


class _CapturingLinear:
    def __call__(self, x):
        box = _CAPTURE.get()
        box.append(x)
        return _vocab_out(x, self.weight.shape[0])


class _CapturingEmbedding:
    def as_linear(self, x):
        box = _CAPTURE.get()
        box.append(x)
        return _vocab_out(x, self.weight.shape[0])


class _WatchedLinear:
    def __call__(self, x):
        _SEEN.get().append(("head", self, x))
        return super().__call__(x)


class _WatchedEmbedding:
    def __call__(self, x):
        _SEEN.get().append(("embed", self, x))
        return super().__call__(x)

    def as_linear(self, x):
        _SEEN.get().append(("head", self, x))
        return super().as_linear(x)


class _ReplacedLinear:
    """The head giving ``_REPLACE``'s array instead of its output: what the model does after
    its head is then read off the model's logits."""

    def __call__(self, x):
        return _REPLACE.get()


class _ReplacedEmbedding:
    def as_linear(self, x):
        return _REPLACE.get()


class _ScaledEmbedding:
    """The input embedding times ``_REPLACE``'s scalar: a path for a gradient through every
    layer that differentiates no weight."""

    def __call__(self, x):
        y = super().__call__(x)
        return y * _REPLACE.get().astype(y.dtype)


_REPLACE: contextvars.ContextVar[mx.array | None] = contextvars.ContextVar(
    "mlxtune_head_replace", default=None
)

_CLASSES: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {})
    return _CLASSES[key]


@dataclass
class LMParts:
    """What the loss needs from a model: the hidden states the LM head reads, the head as a
    matrix, and what the model applies to the head's output (``logit_scale``, ``softcap``)."""

    model: nn.Module
    head_path: str
    """``named_modules`` path of the head: a linear layer, or the tied input embedding."""
    tied: bool
    """The head is an embedding used as a linear map (``as_linear``)."""
    embed_path: str | None
    """Path of the input token embedding (what NEFTune adds noise to)."""
    logit_scale: float = 1.0
    softcap: float | None = None

    @property
    def head(self) -> nn.Module:
        return module_at(self.model, self.head_path)

    def hidden(self, inputs: mx.array) -> mx.array:
        """Final hidden states [B, T, D]: what the model hands its LM head."""
        head = self.head
        cls = type(head)
        head.__class__ = _mixed(_CapturingEmbedding if self.tied else _CapturingLinear, cls)
        box: list = []
        token = _CAPTURE.set(box)
        try:
            self.model(inputs)
        finally:
            _CAPTURE.reset(token)
            head.__class__ = cls
        if len(box) != 1:
            raise RuntimeError(f"the LM head ran {len(box)} times in one forward pass")
        return box[0]

    @property
    def head_bias(self) -> bool:
        return not self.tied and "bias" in self.head

    def head_weight(self) -> mx.array:
        """The head as a [V, D] matrix in loss space: de-quantized, times ``logit_scale``, and
        with the bias as one more column when the head has one (``loss_hidden`` adds the
        matching column of ones)."""
        head = self.head
        w = dense_weight(head)
        if self.head_bias:
            w = mx.concatenate([w, head.bias[:, None].astype(w.dtype)], axis=1)
        return w if self.logit_scale == 1.0 else w * self.logit_scale

    def head_rows(self):
        """The head as the loss kernel reads it: a quantized head without a bias as
        ``kernels.QuantizedRows`` (de-quantized a chunk of rows at a time, never whole), any
        other as ``head_weight()``."""
        head = self.head
        if not is_quantized(head) or self.head_bias:
            return self.head_weight()
        return QuantizedRows(
            head.weight,
            head.scales,
            head.get("biases"),
            head.group_size,
            head.bits,
            mode=getattr(head, "mode", "affine"),
            scale=self.logit_scale,
        )

    def loss_hidden(self, h: mx.array) -> mx.array:
        """Hidden states as ``head_weight`` reads them (a column of ones for a head's bias)."""
        if not self.head_bias:
            return h
        return mx.concatenate([h, mx.ones((*h.shape[:-1], 1), h.dtype)], axis=-1)

    def logits(self, h: mx.array) -> mx.array:
        """fp32 logits of hidden states ``h`` [..., D], as the model computes them."""
        rows = self.head_rows()
        split = getattr(self.head, "reading", None)  # a head split by vocabulary among ranks
        h = h if split is None else split(h)
        if isinstance(rows, mx.array):
            z = self.loss_hidden(h).astype(mx.float32) @ rows.astype(mx.float32).T
        else:  # a quantized head, multiplied from its codes: never de-quantized whole
            z = rows.times_transposed(h).astype(mx.float32)
        z = z if split is None else self.head.gather_logits(z)
        return z if self.softcap is None else self.softcap * mx.tanh(z / self.softcap)

    @property
    def head_names(self) -> set[str]:
        """Parameter names of the head (trainable when they are in a full fine-tune)."""
        return {f"{self.head_path}.{k}" for k, _ in tree_flatten(self.head.parameters())}


def lm_parts(model: nn.Module) -> LMParts:
    """The model's LMParts, found on one short forward pass and checked against its logits;
    a UserInputError naming what differs for a model mlxtune's loss cannot compute."""
    name = family_name(model)
    try:
        probe = _probe(model)
    except UserInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a family's forward is its refusal
        raise UserInputError(
            f"model type {name!r}: its forward pass on token ids fails ({type(e).__name__}: {e})",
            "model",
        ) from None
    return probe


def family_name(model) -> str:
    """The model's model_type (its mlx-lm module's name when its args hold none)."""
    name = getattr(getattr(model, "args", None), "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


class _swapped:
    """``module``'s class mixed with ``mixin`` inside the block, ``var`` set to ``value``."""

    def __init__(self, module, mixin, var, value):
        self.module, self.mixin, self.var, self.value = module, mixin, var, value

    def __enter__(self):
        self.cls = type(self.module)
        self.module.__class__ = _mixed(self.mixin, self.cls)
        self.token = self.var.set(self.value)

    def __exit__(self, *exc):
        self.var.reset(self.token)
        self.module.__class__ = self.cls
        return False


def _probe(model: nn.Module) -> LMParts:
    name = family_name(model)
    was_training = model.training
    model.eval()  # no dropout on the probe
    try:
        x = mx.array([[1, 2, 3, 4, 5, 6]])
        logits = model(x)
        if not isinstance(logits, mx.array) or logits.ndim != 3:
            raise UserInputError(
                f"model type {name!r}: its forward pass gives no [batch, tokens, vocab] logits",
                "model",
            )
        vocab = logits.shape[-1]
        paths = {id(m): p for p, m in model.named_modules()}
        candidates = [
            m
            for _, m in model.named_modules()
            if (isinstance(m, _LINEAR) and m.weight.shape[0] == vocab)
            or (isinstance(m, _EMBEDDING) and m.weight.shape[0] == vocab)
        ]
        seen: list = []
        saved = [(m, type(m)) for m in candidates]
        for m, cls in saved:
            m.__class__ = _mixed(
                _WatchedLinear if isinstance(m, _LINEAR) else _WatchedEmbedding, cls
            )
        token = _SEEN.set(seen)
        try:
            again = model(x)
        finally:
            _SEEN.reset(token)
            for m, cls in saved:
                m.__class__ = cls
        heads = [(m, h) for kind, m, h in seen if kind == "head"]
        if not heads:
            raise UserInputError(
                f"model type {name!r}: no linear map onto its {vocab}-token vocabulary makes its "
                "logits (mlxtune's loss reads the hidden states that map takes)",
                "model",
            )
        head = heads[-1][0]
        embeds = [m for kind, m, _ in seen if kind == "embed"]
        parts = LMParts(
            model,
            head_path=paths[id(head)],
            tied=isinstance(head, _EMBEDDING),
            embed_path=paths[id(embeds[0])] if embeds else None,
        )
        _fit_output(parts, name, x, vocab, logits.dtype)
        # the loss's logits from the captured hidden states are the model's
        ours = np.array(parts.logits(parts.hidden(x)), dtype=np.float64)
        tol = 1e-4 if logits.dtype == mx.float32 else 3e-2
        if not _close(ours, np.array(again.astype(mx.float32), dtype=np.float64), tol):
            raise UserInputError(
                f"model type {name!r}: the logits computed from what its head reads are not "
                "its logits",
                "model",
            )
        _check_gradients(parts, name, x)
        return parts
    finally:
        model.train(was_training)


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    scale = max(float(np.abs(b).max()), 1e-6)
    return a.shape == b.shape and float(np.abs(a - b).max()) <= tol * scale


def _fit_output(parts: LMParts, name: str, x: mx.array, vocab: int, dtype) -> None:
    """Set ``parts``' logit scale and softcap to what the model does after its head: the head
    is made to give a ramp of values from -100 to 100, and the model's logits are read as a
    function of it (the same, a multiple, or a soft cap), or the model is refused."""
    n = x.size * vocab
    ramp = mx.linspace(-100.0, 100.0, n).reshape(*x.shape, vocab).astype(dtype)
    mixin = _ReplacedEmbedding if parts.tied else _ReplacedLinear
    with _swapped(parts.head, mixin, _REPLACE, ramp):
        out = parts.model(x)
    want = np.array(out.astype(mx.float32), dtype=np.float64).reshape(-1)
    z = np.array(ramp.astype(mx.float32), dtype=np.float64).reshape(-1)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    if _close(z, want, tol):
        return
    c = float((z * want).sum() / (z * z).sum())
    if c != 0 and _close(c * z, want, tol):
        parts.logit_scale = _snap(c)
        return
    # a soft cap, after a scale or not: want = cap * tanh(c * z / cap), c read where z is
    # smallest (where the cap bends least), the cap where z is largest
    top = float(np.abs(want).max())
    k = int(np.argmin(np.where(z == 0, np.inf, np.abs(z))))
    if 0 < top < float(np.abs(z).max()) * abs(c) * 2 and abs(want[k]) < top:
        cap, scale = top, want[k] / z[k]
        for _ in range(100):
            cap = top / np.tanh(min(100.0 * abs(scale) / cap, 50.0))
            scale = cap * np.arctanh(want[k] / cap) / z[k]
        cap, scale = _snap(cap), _snap(scale)
        if _close(cap * np.tanh(scale * z / cap), want, tol):
            parts.softcap, parts.logit_scale = cap, (1.0 if scale == 1.0 else scale)
            return
    raise UserInputError(
        f"model type {name!r}: its logits are not its LM head's output (nor a scaled or "
        "soft-capped one), which mlxtune's loss computes",
        "model",
    )


def _snap(v: float) -> float:
    """``v`` at 6 significant digits, or as the reciprocal of such a number (a fitted 0.1250001
    is the 1/8 a config gives), whichever is nearer."""
    a = float(f"{v:.6g}")
    b = 1.0 / float(f"{1.0 / v:.6g}")
    return a if abs(a - v) <= abs(b - v) else b


def _check_gradients(parts: LMParts, name: str, x: mx.array) -> None:
    """A gradient through every layer (to a scale on the input embedding, no weight's): a
    family whose forward MLX cannot differentiate is refused before any training."""
    if parts.embed_path is None:
        return
    emb = module_at(parts.model, parts.embed_path)

    def total(s):
        with _swapped(emb, _ScaledEmbedding, _REPLACE, s):
            return parts.hidden(x).astype(mx.float32).sum()

    try:
        mx.eval(mx.grad(total)(mx.array(1.0)))
    except ValueError as e:
        raise UserInputError(
            f"model type {name!r}: MLX cannot differentiate its forward pass ({e})", "model"
        ) from None


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; a quantized layer counts its weight's logical
    entries (not its packed words, scales and offsets)."""
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    for _, m in model.named_modules():
        if is_quantized(m):
            packed = m.weight.size + m.scales.size + (m.biases.size if "biases" in m else 0)
            total += m.weight.size * 32 // m.bits - packed
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    return trainable, total
