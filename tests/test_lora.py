"""LoRA and DoRA layers against naive MLX references (values and gradients), and adapter
placement by name and layer range."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxtune.adapters import DoRALinear, LoRALinear, apply_adapters, select_layers
from mlxtune.errors import UserInputError
from mlxtune.models import load_model


def _layer(cls, bias=False, seed=0):
    mx.random.seed(seed)
    base = nn.Linear(12, 10, bias=bias)
    layer = cls.from_base(base, rank=4, alpha=8.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1  # non-zero, to test the math
    return layer


def _naive_lora(x, w, b, a, bb, scale):
    y = x @ (w + scale * (a @ bb).T).T
    return y + b if b is not None else y


def _naive_dora(x, w, b, a, bb, scale, m):
    adapted = w + scale * (a @ bb).T
    y = (x @ adapted.T) * (m / mx.sqrt((adapted * adapted).sum(axis=1)))
    return y + b if b is not None else y


@pytest.mark.parametrize("bias", [False, True])
def test_lora_values_and_gradients_match_naive(bias):
    layer = _layer(LoRALinear, bias)
    x = mx.random.normal((3, 5, 12))
    w, b = layer.linear.weight, layer.linear.get("bias")

    def ours(a, bb):
        layer.lora_a, layer.lora_b = a, bb
        return (layer(x) ** 2).sum()

    def ref(a, bb):
        return (_naive_lora(x, w, b, a, bb, layer.scale) ** 2).sum()

    a0, b0 = layer.lora_a, layer.lora_b
    assert abs(ours(a0, b0).item() - ref(a0, b0).item()) < 1e-4 * abs(ref(a0, b0).item())
    ga = mx.grad(ours, argnums=(0, 1))(a0, b0)
    gr = mx.grad(ref, argnums=(0, 1))(a0, b0)
    for g1, g2 in zip(ga, gr, strict=True):
        np.testing.assert_allclose(np.array(g1), np.array(g2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_dora_values_and_gradients_match_naive(bias):
    layer = _layer(DoRALinear, bias)
    layer.m = layer.m * 1.3
    x = mx.random.normal((4, 12))
    w, b = layer.linear.weight, layer.linear.get("bias")

    def ours(a, bb, m):
        layer.lora_a, layer.lora_b, layer.m = a, bb, m
        return (layer(x) ** 2).sum()

    def ref(a, bb, m):
        return (_naive_dora(x, w, b, a, bb, layer.scale, m) ** 2).sum()

    args = (layer.lora_a, layer.lora_b, layer.m)
    assert abs(ours(*args).item() - ref(*args).item()) < 1e-4 * abs(ref(*args).item())
    for g1, g2 in zip(
        mx.grad(ours, argnums=(0, 1, 2))(*args), mx.grad(ref, argnums=(0, 1, 2))(*args), strict=True
    ):
        np.testing.assert_allclose(np.array(g1), np.array(g2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [LoRALinear, DoRALinear])
def test_adapter_starts_as_the_base_and_fuses_exactly(cls):
    mx.random.seed(1)
    base = nn.Linear(12, 10, bias=True)
    layer = cls.from_base(base, rank=4, alpha=8.0)
    x = mx.random.normal((6, 12))
    np.testing.assert_allclose(np.array(layer(x)), np.array(base(x)), rtol=1e-5, atol=1e-5)  # B = 0
    assert (np.array(layer.lora_b) == 0).all() and np.abs(np.array(layer.lora_a)).max() > 0
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    fused = layer.fused()
    np.testing.assert_allclose(np.array(fused(x)), np.array(layer(x)), rtol=1e-4, atol=1e-5)


def test_lora_over_a_quantized_base_matches_dequantized_reference():
    mx.random.seed(2)
    base = nn.Linear(64, 32, bias=False)
    q = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
    layer = LoRALinear.from_base(q, rank=4, alpha=8.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
    w = mx.dequantize(q.weight, q.scales, q.biases, 32, 4)
    x = mx.random.normal((5, 64))
    ref = _naive_lora(x, w, None, layer.lora_a, layer.lora_b, layer.scale)
    np.testing.assert_allclose(np.array(layer(x)), np.array(ref), rtol=1e-3, atol=1e-3)


def test_dropout_only_in_training():
    mx.random.seed(3)
    layer = LoRALinear.from_base(nn.Linear(12, 10), rank=4, alpha=8.0, dropout=0.5)
    layer.lora_b = mx.ones(layer.lora_b.shape)
    x = mx.random.normal((4, 12))
    layer.train()
    a, b = layer(x), layer(x)
    assert not np.allclose(np.array(a), np.array(b))
    layer.eval()
    assert np.allclose(np.array(layer(x)), np.array(layer(x)))


def test_select_layers():
    assert select_layers(6, None) == [0, 1, 2, 3, 4, 5]
    assert select_layers(6, 2) == [4, 5]
    assert select_layers(6, "1-3") == [1, 2, 3]
    assert select_layers(6, [5, 0, 5]) == [0, 5]
    with pytest.raises(UserInputError, match="layer 9 does not exist"):
        select_layers(6, [9])


def test_apply_adapters_targets_by_name_and_range_and_freezes_the_base(model_dir_factory):
    model, _ = load_model(model_dir_factory("llama", num_hidden_layers=3))
    info = apply_adapters(model, "lora", 4, 8.0, 0.0, ["q_proj", "down_proj"], "1-2")
    assert sorted(info["adapted"]) == sorted(
        f"layers.{i}.{n}" for i in (1, 2) for n in ("self_attn.q_proj", "mlp.down_proj")
    )
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert all(k.endswith(("lora_a", "lora_b")) for k in trainable)
    assert len(trainable) == 8
    assert not isinstance(model.layers[0].self_attn.q_proj, LoRALinear)
    assert isinstance(model.layers[2].mlp.down_proj, LoRALinear)


def test_all_linear_dora_and_full(model_dir_factory):
    model, _ = load_model(model_dir_factory("llama"))
    info = apply_adapters(model, "dora", 4, 8.0, 0.0, ["all-linear"])
    assert len(info["adapted"]) == 2 * 7
    names = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert sum(k.endswith(".m") for k in names) == 14
    model, _ = load_model(model_dir_factory("llama"))
    apply_adapters(model, "full", 4, 8.0, 0.0, ["q_proj"])
    assert len(tree_flatten(model.trainable_parameters())) == len(tree_flatten(model.parameters()))


def test_unknown_target_names_the_real_layers(model_dir_factory):
    model, _ = load_model(model_dir_factory("llama"))
    with pytest.raises(UserInputError, match="no layer named 'qproj'.*q_proj"):
        apply_adapters(model, "lora", 4, 8.0, 0.0, ["qproj"])


@pytest.mark.parametrize("cls", [LoRALinear, DoRALinear])
@pytest.mark.parametrize("rank", [4, 16])
def test_rslora_scales_the_update_by_alpha_over_sqrt_rank(cls, rank):
    mx.random.seed(1)
    base = nn.Linear(12, 10)
    x = mx.random.normal((2, 3, 12))
    for rslora, scale in ((False, 8.0 / rank), (True, 8.0 / rank**0.5)):
        layer = cls.from_base(base, rank=rank, alpha=8.0, rslora=rslora)
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.1
        args = (x, base.weight, base.bias, layer.lora_a, layer.lora_b, scale)
        want = _naive_dora(*args, layer.m) if cls is DoRALinear else _naive_lora(*args)
        np.testing.assert_allclose(np.array(layer(x)), np.array(want), rtol=1e-5, atol=1e-5)
