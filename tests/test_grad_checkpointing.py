"""Gradient checkpointing per layer (train.grad_checkpointing): the same loss and gradients as
without it (LoRA, full, dropout, packed rows, compiled), unchanged parameter names, a measured
memory win, generation untouched, and the memory estimate's view of it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import load_minimal, measured_peak, peak_memory_mb, tiny_arch, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.adapters import apply_adapters
from mlxtune.console import Console
from mlxtune.errors import UserInputError
from mlxtune.memory import alternatives, estimate, shape_of
from mlxtune.models import (
    build_model,
    checkpoint_layers,
    checkpointed_layers,
    kernel_attention,
    load_model,
    segments,
)

TOKENS = mx.array(
    [[1, 5, 9, 12, 7, 3, 22, 4, 17, 8, 2, 19], [2, 30, 11, 6, 14, 9, 5, 40, 3, 1, 33, 27]]
)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="sum")


def _model(model_dir_factory, kind: str, dropout: float = 0.0):
    model, _ = load_model(model_dir_factory("llama", num_hidden_layers=3))
    mx.random.seed(11)
    apply_adapters(model, kind, 4, 8.0, dropout, ["all-linear"])
    if kind != "full":  # a non-zero B, so that every LoRA gradient is live
        model.load_weights(
            [
                (k, mx.random.normal(v.shape) * 0.1)
                for k, v in tree_flatten(model.trainable_parameters())
                if k.endswith("lora_b")
            ],
            strict=False,
        )
    mx.eval(model.parameters())
    return model


def _assert_close(a, b, tol: float = 1e-5):
    """Equal up to fp32 rounding: the largest difference within tol of the largest value."""
    a, b = np.array(a), np.array(b)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-30)


def _assert_same(run_a, run_b):
    (loss_a, grads_a), (loss_b, grads_b) = run_a, run_b
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    ga, gb = dict(tree_flatten(grads_a)), dict(tree_flatten(grads_b))
    assert set(ga) == set(gb)
    for k in ga:
        _assert_close(ga[k], gb[k])


@pytest.mark.parametrize("every, covered", [(1, 3), (2, 2)])
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_loss_and_every_gradient_are_unchanged(model_dir_factory, kind, every, covered):
    model = _model(model_dir_factory, kind)
    names = [k for k, _ in tree_flatten(model.parameters())]
    trainable = [k for k, _ in tree_flatten(model.trainable_parameters())]
    step = nn.value_and_grad(model, _loss)
    plain = step(model, TOKENS)
    mx.eval(plain)
    assert checkpoint_layers(model, every) == covered == checkpointed_layers(model)
    chosen = [i for i in range(3) if i % every == 0]
    assert [type(b).__name__.startswith("Checkpointed") for b in model.layers] == [
        i in chosen for i in range(3)
    ]
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert [k for k, _ in tree_flatten(model.trainable_parameters())] == trainable
    assert len(dict(tree_flatten(plain[1]))) == len(trainable)
    _assert_same(step(model, TOKENS), plain)
    # compiled, as the trainer runs it
    state = [model.state]
    compiled = mx.compile(lambda t: step(model, t), inputs=state, outputs=state)
    _assert_same(compiled(TOKENS), plain)
    # a second call of checkpoint_layers changes nothing
    assert checkpoint_layers(model, 1) == 3 and checkpointed_layers(model) == 3
    _assert_same(step(model, TOKENS), plain)


def test_only_the_chosen_instances_change(model_dir_factory):
    a = _model(model_dir_factory, "lora")
    b = _model(model_dir_factory, "lora")
    checkpoint_layers(a, 2)
    assert checkpointed_layers(b) == 0
    assert type(b.layers[0]) is type(a.layers[1])
    assert isinstance(a.layers[0], type(b.layers[0]))


def test_dropout_masks_are_the_same_when_the_backward_pass_recomputes(model_dir_factory):
    """The gradient belongs to the loss the forward computed: a central difference along a
    random direction (with the same dropout masks, from the same seed) agrees with it."""
    model = _model(model_dir_factory, "lora", dropout=0.5)
    model.train()
    checkpoint_layers(model, 1)
    params = model.trainable_parameters()

    def loss_at(p):
        model.update(p)
        mx.random.seed(5)
        return _loss(model, TOKENS)

    mx.random.seed(6)
    assert abs(_loss(model, TOKENS).item() - loss_at(params).item()) > 1e-3  # dropout is on
    step = nn.value_and_grad(model, _loss)
    mx.random.seed(5)
    _, grads = step(model, TOKENS)
    mx.random.seed(1)
    direction = tree_map(lambda g: mx.random.normal(g.shape), grads)
    norm = mx.sqrt(sum((d * d).sum() for _, d in tree_flatten(direction)))
    direction = tree_map(lambda d: d / norm, direction)
    slope = sum(
        (g * d).sum()
        for (_, g), (_, d) in zip(tree_flatten(grads), tree_flatten(direction), strict=True)
    )
    eps = 0.03  # along a unit direction: the difference's own error is ~1e-3 of the slope
    up = loss_at(tree_map(lambda w, d: w + eps * d, params, direction))
    down = loss_at(tree_map(lambda w, d: w - eps * d, params, direction))
    model.update(params)
    numeric = (up - down) / (2 * eps)
    assert numeric.item() == pytest.approx(slope.item(), rel=5e-3)


def test_packed_rows_keep_their_segments_in_the_recomputed_pass(model_dir_factory):
    model = _model(model_dir_factory, "lora")
    ids = mx.array([[1] * 5 + [2] * 6, [1] * 8 + [0] * 3])

    def loss(m, tokens):  # segments only around the forward, as the trainer's loss has it
        with segments(ids):
            logits = m(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="sum")

    with kernel_attention(model, "chunked"):
        step = nn.value_and_grad(model, loss)
        plain = step(model, TOKENS)
        unpacked = nn.value_and_grad(model, _loss)(model, TOKENS)
        mx.eval(plain, unpacked)
        checkpoint_layers(model, 1)
        _assert_same(step(model, TOKENS), plain)
    assert abs(plain[0].item() - unpacked[0].item()) > 1e-3  # the segments do matter here


def test_generation_with_a_cache_is_unchanged(model_dir_factory):
    from mlx_lm.models.cache import make_prompt_cache

    model = _model(model_dir_factory, "lora")
    model.eval()
    cache = make_prompt_cache(model)
    before = [model(TOKENS[:1, :6], cache=cache), model(TOKENS[:1, 6:7], cache=cache)]
    checkpoint_layers(model, 1)
    cache = make_prompt_cache(model)
    after = [model(TOKENS[:1, :6], cache=cache), model(TOKENS[:1, 6:7], cache=cache)]
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_bad_strides_are_refused(model_dir_factory):
    model = _model(model_dir_factory, "lora")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="every"):
            checkpoint_layers(model, bad)
    assert checkpointed_layers(model) == 0


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_checkpointing_lowers_the_peak_memory(kind):
    arch = tiny_arch("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4)
    mx.random.seed(0)
    tokens = mx.random.randint(0, 60, (4, 257))
    peaks = []
    for every in (None, 2, 1):
        model, _ = build_model(arch, 60, seed=0)
        apply_adapters(model, kind, 4, 8.0, 0.0, ["all-linear"])
        if every:
            checkpoint_layers(model, every)
        peaks.append(peak_memory_mb(nn.value_and_grad(model, _loss), model, tokens))
    none, half, every_layer = peaks
    assert every_layer < half < none and every_layer < 0.75 * none, peaks


# ---------------------------------------------------------------------------- recipe, memory


def _load(tmp_path, overrides):
    return load_minimal(tmp_path, overrides)


def test_recipe_values(tmp_path):
    assert _load(tmp_path, []).train.grad_checkpointing is False
    for text, value in (("true", True), ("false", False), ("1", 1), ("3", 3), ("on", True)):
        got = _load(tmp_path, [f"train.grad_checkpointing={text}"]).train.grad_checkpointing
        assert got == value and type(got) is type(value)
    for text in ("0", "-2", "1.5", "every", "[1]"):
        with pytest.raises(UserInputError) as e:
            _load(tmp_path, [f"train.grad_checkpointing={text}"])
        assert "train.grad_checkpointing:" in str(e.value)


@pytest.mark.parametrize("setting, covered", [(False, 0), (True, 3), (2, 2), (5, 1)])
def test_the_estimate_counts_checkpointed_layers(
    tmp_path, data_dir, model_dir_factory, setting, covered
):
    model_dir = model_dir_factory("llama", num_hidden_layers=3)
    r = tiny_recipe(data_dir, model_dir)
    r["train"]["grad_checkpointing"] = setting
    tr = Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True))
    shape = shape_of(tr)
    assert shape.checkpointed == covered
    if covered > 1:  # (one block of three saves nothing: it recomputes while the others wait)
        off = estimate(shape.__class__(**{**shape.__dict__, "checkpointed": 0}))
        assert estimate(shape)["activations"] < off["activations"]
        assert estimate(shape)["weights"] == off["weights"]


def test_alternatives_suggest_checkpointing_when_it_is_off(tmp_path, data_dir, llama_dir):
    from dataclasses import replace

    r = recipe_from_dict(tiny_recipe(data_dir, llama_dir))
    tr = Trainer(r, tmp_path / "r", console=Console(quiet=True))
    shape = replace(shape_of(tr), batch=64, length=2048)  # activations dominate
    on = estimate(replace(shape, checkpointed=shape.layers))["total"]
    assert on < estimate(shape)["total"]
    out = alternatives(shape, on * 1.01, r)
    assert any(o.startswith("train.grad_checkpointing: true") for o in out), out
    assert not any(
        "grad_checkpointing" in o
        for o in alternatives(replace(shape, checkpointed=shape.layers), on * 1.01, r)
    )


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_the_estimate_is_close_to_the_measured_peak_with_checkpointing(
    tmp_path, tokenizer, tokenizer_dir, kind
):
    import random

    from conftest import write_jsonl
    from mlxtune.models import save_model

    model, config = build_model(
        tiny_arch("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4),
        len(tokenizer._tokenizer),
        seed=1,
    )
    save_model(model, config, tmp_path / "model", tokenizer, tokenizer_dir)
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "there"]
    rows = [{"text": " ".join(rng.choice(words) for _ in range(120))} for _ in range(24)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    recipe = {
        "model": {"path": str(tmp_path / "model")},
        "data": {"train": str(tmp_path / "train.jsonl"), "format": "text", "max_length": 160},
        "adapter": {"type": kind, "targets": ["q_proj", "v_proj"]},
        "train": {"batch_size": 8, "max_steps": 2, "progress": False, "grad_checkpointing": True},
        "eval": {"every": None},
    }
    tr = Trainer(recipe_from_dict(recipe), tmp_path / "r", console=Console(quiet=True))
    assert checkpointed_layers(tr.model) == 4  # the trainer applied it, as the recipe asks
    peak = measured_peak(tr)
    est = estimate(shape_of(tr))["total"]
    assert 0.6 < est / peak < 1.6, (est, peak)
    # the trainer's step really recomputes: the same run without it peaks higher
    recipe["train"]["grad_checkpointing"] = False
    plain = Trainer(recipe_from_dict(recipe), tmp_path / "plain", console=Console(quiet=True))
    assert checkpointed_layers(plain.model) == 0
    plain_peak = measured_peak(plain)
    # measured on a CPU: 0.88 of it (full: the optimizer state weighs more), 0.74 (LoRA)
    assert peak < 0.95 * plain_peak, (peak, plain_peak)


@pytest.mark.parametrize("packing", ["off", "pack"])
def test_a_training_run_is_unchanged_by_checkpointing(tmp_path, data_dir, llama_dir, packing):
    import json

    def losses(name, checkpointing):
        r = tiny_recipe(data_dir, llama_dir, eval={"every": None})
        r["data"]["packing"] = packing
        r["adapter"]["targets"] = ["all-linear"]
        r["train"].update(log_every=1, grad_checkpointing=checkpointing)
        tr = Trainer(recipe_from_dict(r), tmp_path / name, console=Console(quiet=True))
        assert checkpointed_layers(tr.model) == (2 if checkpointing else 0)
        tr.run()
        rows = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in rows if "grad_norm" in json.loads(x)]

    plain = losses("plain", False)
    assert len(plain) == 6
    np.testing.assert_allclose(losses("checkpointed", True), plain, rtol=1e-6)
