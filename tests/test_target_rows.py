"""The loss over target positions only: ``target_rows`` picks the positions whose next token is a
target (a chat's prompt is not), and the objective runs the LM head and the loss over them. The
losses and gradients are those of the full logits over every position."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.data import make_batch
from mlxtune.objectives import target_rows


def test_rows_are_the_targets_then_a_non_target_filler():
    rng = np.random.default_rng(0)
    mask = np.zeros((6, 41), dtype=np.int32)
    for i in range(6):  # a prompt, then an answer of 5-15 tokens, then padding
        start = int(rng.integers(5, 20))
        mask[i, start : start + int(rng.integers(5, 16))] = 1
    rows = target_rows(mask)
    flat = mask[:, 1:].reshape(-1)
    k = int(flat.sum())
    assert rows.dtype == np.int32
    assert rows[:k].tolist() == [i for i, m in enumerate(flat) if m]
    assert len(rows) >= k and len(rows) % 16 == 0 and len(rows) < flat.size
    assert all(flat[i] == 0 for i in rows[k:])  # filler: no target, its loss is 0


def test_no_rows_where_they_would_save_little():
    assert target_rows(np.ones((4, 33), dtype=np.int32)) is None  # plain text
    mostly = np.ones((4, 33), dtype=np.int32)
    mostly[:, :3] = 0  # 2 of 32 positions a row are prompt: all rows are nearly targets
    assert target_rows(mostly) is None
    half = np.ones((4, 33), dtype=np.int32)
    half[:, :17] = 0
    assert len(target_rows(half)) == 64  # 64 targets of 128 positions


def test_few_shapes_over_many_batches():
    """The padded sizes come in steps of an eighth of the positions: the compiled step sees
    few shapes."""
    rng = np.random.default_rng(1)
    sizes = set()
    for _ in range(200):
        mask = (rng.random((8, 97)) < rng.uniform(0.2, 0.7)).astype(np.int32)
        rows = target_rows(mask)
        sizes.add(None if rows is None else len(rows))
    assert len(sizes) <= 8


def naive_token_losses(model, tokens, mask):
    """Per-position cross-entropy [B, T-1] from the full logits, 0 off-target (MLX fp32)."""
    logits = model(tokens[:, :-1]).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="none")
    return ce * (mask[:, 1:] > 0)


@pytest.fixture
def trainer(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(data_dir, llama_dir)
    return Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True))


def test_loss_and_lora_gradients_over_target_rows_match_the_full_logits(trainer):
    tr = trainer
    b = make_batch(tr.train_set.examples[:8], tr.pad_id, 8)
    arrays = tr.engine.arrays(b)
    assert "rows" in arrays and arrays["rows"].size < b.tokens.shape[0] * (b.tokens.shape[1] - 1)
    tokens, mask = mx.array(b.tokens), mx.array(b.mask)

    # values, in float64 from the full logits
    logits = np.array(tr.model(tokens[:, :-1]), dtype=np.float64)
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, b.tokens[:, 1:, None], axis=-1)[..., 0]
    want = np.where(b.mask[:, 1:] > 0, lse - picked, 0.0)
    per, n = tr.objective.token_losses(arrays, reduction="none")
    np.testing.assert_allclose(np.array(per), want, rtol=1e-5, atol=1e-5)
    loss, count, _ = tr.objective.loss(tr.model, arrays)
    assert count.item() == b.n_targets
    assert loss.item() == pytest.approx(want.sum(), rel=1e-5)

    # the step's LoRA gradients against the full logits' (loss / count, as the engine scales)
    inv = mx.array(1.0 / b.n_targets)
    _, _, _, grads = tr.engine.grad_step(arrays, inv)

    def naive(model):
        return naive_token_losses(model, tokens, mask).sum() * inv

    _, ref = nn.value_and_grad(tr.model, naive)(tr.model)
    got, ref = dict(tree_flatten(grads)), dict(tree_flatten(ref))
    assert got.keys() == ref.keys() and len(got) > 0
    for k in got:
        scale = max(float(mx.abs(ref[k]).max()), 1e-12)
        assert float(mx.abs(got[k] - ref[k]).max()) <= 1e-4 * scale, k


def test_plain_text_batches_take_every_position(trainer):
    tr = trainer
    b = make_batch(tr.train_set.examples[:4], tr.pad_id, 8)
    b.mask[:] = 1  # every position a target, as unpadded plain text
    b.n_targets = int(b.mask[:, 1:].sum())
    arrays = tr.engine.arrays(b)
    assert "rows" not in arrays
    loss, count, _ = tr.objective.loss(tr.model, arrays)
    want = naive_token_losses(tr.model, mx.array(b.tokens), mx.array(b.mask)).sum()
    assert count.item() == b.n_targets
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
