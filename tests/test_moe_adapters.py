"""LoRA and DoRA on a mixture of experts' stacked projections (mlx-lm's SwitchLinear), against
the per-expert formula written out token by token in NumPy float64; routers left as trained."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchLinear

from mlxtune.adapters import DoRASwitchLinear, LoRASwitchLinear, apply_adapters
from mlxtune.models import build_model

E, IN, OUT, R, K = 4, 32, 12, 3, 2


def layer(kind, quantized=False):
    mx.random.seed(1)
    base = SwitchLinear(IN, OUT, E, bias=True)
    base.bias = mx.random.normal((E, OUT)) * 0.1
    if quantized:
        base = base.to_quantized(group_size=32, bits=8)
    cls = DoRASwitchLinear if kind == "dora" else LoRASwitchLinear
    a = cls.from_base(base, rank=R, alpha=6.0)
    a.lora_b = mx.random.normal(a.lora_b.shape) * 0.3  # a trained-looking update
    if kind == "dora":
        a.m = a.m * (1 + 0.2 * mx.random.uniform(shape=a.m.shape))
    return a


def weight_of(base):
    if hasattr(base, "scales"):
        return mx.dequantize(base.weight, base.scales, base.biases, group_size=32, bits=8)
    return base.weight


def params_of(a) -> dict:
    return {k: np.array(a[k], dtype=np.float64) for k in ("lora_a", "lora_b", "m") if k in a}


def formula(a, params, x, idx, kind):
    """y[t, j] = expert idx[t, j]'s adapted map of x[t], in float64, one token at a time."""
    w = np.array(weight_of(a.linear), dtype=np.float64)
    b = np.array(a.linear.bias, dtype=np.float64)
    A, B = params["lora_a"], params["lora_b"]
    x, idx = np.array(x, dtype=np.float64), np.array(idx)
    out = np.zeros((*idx.shape, OUT))
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            adapted = w[e] + a.scale * B[e] @ A[e]
            if kind == "dora":
                adapted = adapted * (params["m"][e] / np.linalg.norm(adapted, axis=1))[:, None]
            out[t, j] = adapted @ x[t] + b[e]
    return out


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("quantized", [False, True])
def test_expert_adapters_match_the_per_expert_formula(kind, quantized):
    a = layer(kind, quantized)
    x = mx.random.normal((5, IN))
    idx = mx.array([[0, 2], [1, 3], [2, 2], [3, 0], [1, 0]])
    # mlx-lm's SwitchGLU calls its projections with x [tokens, 1, 1, in] and indices [tokens, k]
    y = a(x[:, None, None, :], idx)[:, :, 0, :]
    want = formula(a, params_of(a), x, idx, kind)
    np.testing.assert_allclose(np.array(y), want, rtol=1e-4, atol=1e-4)
    # the fused layer computes the same
    fused = a.fused()
    assert isinstance(fused, SwitchLinear)
    np.testing.assert_allclose(
        np.array(fused(x[:, None, None, :], idx)[:, :, 0, :]), want, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_expert_adapter_gradients_match_finite_differences_of_the_formula(kind):
    a = layer(kind)
    a.freeze()
    a.unfreeze(keys=["lora_a", "lora_b", *(["m"] if kind == "dora" else [])])
    x = mx.random.normal((4, IN))
    idx = mx.array([[0, 2], [1, 3], [2, 1], [3, 0]])
    c = mx.random.normal((4, K, OUT))

    def loss(layer):
        return (layer(x[:, None, None, :], idx)[:, :, 0, :] * c).sum()

    grads = dict(tree_flatten(nn.value_and_grad(a, loss)(a)[1]))
    assert set(grads) == set(params_of(a))
    cc = np.array(c, dtype=np.float64)
    rng = np.random.default_rng(0)
    for name, g in grads.items():
        base = params_of(a)
        for i in rng.choice(base[name].size, size=10, replace=False):
            diff = 0.0
            for sign in (1, -1):
                moved = {k: v.copy() for k, v in base.items()}
                moved[name].reshape(-1)[i] += sign * 1e-6
                diff += sign * (formula(a, moved, x, idx, kind) * cc).sum()
            want = diff / 2e-6
            assert float(np.array(g).reshape(-1)[i]) == pytest.approx(want, rel=1e-3, abs=1e-4)


def qwen3_moe():
    from mlx_lm_archs import tiny_config

    return build_model(tiny_config("qwen3_moe", 64), 64)[0]


def test_routers_stay_as_trained_unless_named():
    model = qwen3_moe()
    info = apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    assert "layers.0.mlp.switch_mlp.gate_proj" in info["adapted"]
    assert not any(n.endswith("mlp.gate") for n in info["adapted"])
    names = {k for k, _ in tree_flatten(model.trainable_parameters())}
    assert not any(".mlp.gate." in k for k in names)
    assert isinstance(model.layers[0].mlp.switch_mlp.up_proj, LoRASwitchLinear)
    named = qwen3_moe()
    info = apply_adapters(named, "lora", 4, 8.0, 0.0, ["gate"])
    assert info["adapted"] == ["layers.0.mlp.gate", "layers.1.mlp.gate"]


@pytest.mark.parametrize("sort", [False, True])
def test_the_cpus_de_quantizing_experts_give_the_quantized_layers_values_and_gradients(sort):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlxtune.models.quantize import DequantizingSwitchLinear

    mx.random.seed(3)
    q = SwitchLinear(IN, OUT, E, bias=True).to_quantized(group_size=32, bits=4)
    q.bias = mx.random.normal((E, OUT)) * 0.1
    assert type(q) is QuantizedSwitchLinear
    x = mx.random.normal((6, 1, 1, IN))
    idx = mx.array([[0, 2], [1, 3], [2, 2], [3, 0], [1, 0], [2, 3]])
    if sort:  # as SwitchGLU sorts many tokens: one row a (token, expert) pair
        x, idx = mx.repeat(x, 2, axis=0).reshape(12, 1, IN), idx.reshape(12)
        order = mx.argsort(idx)
        x, idx = x[order], idx[order]
    c = mx.random.normal(q(x, idx, sorted_indices=sort).shape)

    def run(layer):
        def loss(x):
            return (layer(x, idx, sorted_indices=sort) * c).sum()

        return mx.value_and_grad(loss)(x)

    want, want_dx = run(q)
    q.__class__ = DequantizingSwitchLinear
    got, dx = run(q)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    np.testing.assert_allclose(np.array(dx), np.array(want_dx), rtol=1e-4, atol=1e-5)


def test_qlora_quantizes_the_experts_and_trains_over_them(tmp_path, data_dir, family_dir_moe):
    from test_families import learned, run

    from mlxtune.models.quantize import DequantizingSwitchLinear

    tr, losses = run(
        tmp_path,
        data_dir,
        family_dir_moe,
        adapter={"type": "lora", "rank": 4, "alpha": 16, "targets": ["all-linear"]},
        model={"path": str(family_dir_moe), "quantize": {"bits": 4, "group_size": 32}},
        optimizer={"lr": 1e-1},
    )
    assert learned(losses), losses
    experts = [m for _, m in tr.model.named_modules() if isinstance(m, LoRASwitchLinear)]
    assert experts and all(type(m.linear) is DequantizingSwitchLinear for m in experts)


@pytest.fixture
def family_dir_moe(tmp_path, tokenizer, tokenizer_dir):
    from mlx_lm_archs import tiny_config

    from mlxtune.models import family_classes, save_model

    mx.random.seed(2)
    config = tiny_config("qwen3_moe", 64)
    model_class, args_class = family_classes(config)
    folder, _ = save_model(
        model_class(args_class.from_dict(config)), config, tmp_path / "m", tokenizer, tokenizer_dir
    )
    return folder


def test_a_peft_export_of_expert_adapters_is_refused_by_name(tmp_path, data_dir, family_dir_moe):
    from test_families import run

    from mlxtune.errors import UserInputError

    with pytest.raises(UserInputError, match="mlp.switch_mlp.* is a mixture's experts"):
        run(
            tmp_path,
            data_dir,
            family_dir_moe,
            adapter={"type": "lora", "rank": 4, "alpha": 16, "targets": ["all-linear"]},
            export={"formats": ["peft"]},
        )
