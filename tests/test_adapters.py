"""adapters_disabled: with its adapters off, an adapted model is its base model, checked against
the base's logits recorded before any adapter went in (LoRA, DoRA, a quantized base), inside
mx.compile, under nn.value_and_grad, nested, and after an exception."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_arch
from mlxtune.adapters import DoRALinear, LoRALinear, adapters_disabled, apply_adapters
from mlxtune.models import build_model, quantize_model

TOKENS = mx.array([[1, 5, 9, 12, 7, 3, 22, 4], [2, 30, 11, 6, 14, 9, 5, 40]])
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _adapted(kind: str, quantized: bool = False, dropout: float = 0.0):
    """(model with adapters whose B is non-zero, the base's logits recorded before they went in)."""
    model, _ = build_model(tiny_arch("llama"), 48, seed=3)
    if quantized:
        quantize_model(model, bits=4, group_size=32)
    reference = model(TOKENS)
    mx.eval(reference)
    apply_adapters(model, kind, rank=4, alpha=8.0, dropout=dropout, targets=TARGETS)
    mx.random.seed(11)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.5
            if isinstance(m, DoRALinear):
                m.m = m.m * 1.5  # a trained magnitude: off must not apply it either
    return model, np.array(reference)


def _close(a, b) -> bool:
    return np.allclose(np.array(a), b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("quantized", [False, True])
def test_disabled_adapters_give_the_base_logits(kind, quantized):
    model, reference = _adapted(kind, quantized)
    adapted = np.array(model(TOKENS))
    assert not np.allclose(adapted, reference, atol=1e-3)  # the adapters do change the logits
    with adapters_disabled(model):
        assert _close(model(TOKENS), reference)
    assert np.array_equal(np.array(model(TOKENS)), adapted)  # on again after the block


def test_disabled_adapters_skip_dropout():
    model, reference = _adapted("lora", dropout=0.5)
    model.train()
    mx.random.seed(0)
    first = np.array(model(TOKENS))
    second = np.array(model(TOKENS))
    assert not np.allclose(first, second, atol=1e-4)  # dropout draws differ between calls
    with adapters_disabled(model):
        assert _close(model(TOKENS), reference)
        assert _close(model(TOKENS), reference)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_disabled_inside_a_compiled_function(kind):
    model, reference = _adapted(kind)
    adapted = np.array(model(TOKENS))

    @mx.compile
    def both(x):
        with adapters_disabled(model):
            base = model(x)
        return base, model(x)

    base, on = both(TOKENS)
    assert _close(base, reference)
    assert np.allclose(np.array(on), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_no_adapter_gradient_from_a_loss_under_disabled(kind):
    model, _ = _adapted(kind)
    targets = mx.array(np.roll(np.array(TOKENS), -1, axis=1))

    def loss(off: bool):
        def f(m, x):
            if off:
                with adapters_disabled(m):
                    logits = m(x)
            else:
                logits = m(x)
            return nn.losses.cross_entropy(logits, targets, reduction="mean")

        return f

    _, on = nn.value_and_grad(model, loss(False))(model, TOKENS)
    _, off = nn.value_and_grad(model, loss(True))(model, TOKENS)
    on, off = tree_flatten(on), tree_flatten(off)
    names = [k for k, _ in on]
    assert names and all(("lora_" in k or k.endswith(".m")) for k in names)  # adapters only
    assert any(np.abs(np.array(g)).max() > 0 for _, g in on)
    assert all(np.abs(np.array(g)).max() == 0 for _, g in off)


def test_restored_after_an_exception_and_when_nested():
    model, reference = _adapted("lora")
    adapted = np.array(model(TOKENS))
    with pytest.raises(RuntimeError, match="boom"):
        with adapters_disabled(model):
            raise RuntimeError("boom")
    assert np.array_equal(np.array(model(TOKENS)), adapted)
    with adapters_disabled(model):
        with adapters_disabled(model):
            assert _close(model(TOKENS), reference)
        assert _close(model(TOKENS), reference)  # the outer block still holds
    assert np.array_equal(np.array(model(TOKENS)), adapted)


def test_only_the_given_model_is_disabled():
    model, _ = _adapted("lora")
    other, _ = _adapted("lora")
    other_on = np.array(other(TOKENS))
    with adapters_disabled(model):
        assert np.array_equal(np.array(other(TOKENS)), other_on)
