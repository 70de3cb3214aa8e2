"""Packing: several examples a row with segment ids (attention never crosses them, the logits of
each example are those it has alone, the loss masks the boundaries), the token-stream mode, and
packed runs that resume exactly."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import TIMING, crash_and_resume, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.data import (
    Example,
    make_batch,
    make_packed_batch,
    pack_rows,
    split_batch,
    stream_rows,
)
from mlxtune.errors import UserInputError
from mlxtune.models import kernel_attention, load_model, segments

IGNORE = -100


def best_fit_row_count(lengths: list[int], capacity: int) -> int:
    """Rows that best-fit decreasing fills, done naively: each example, longest first, goes to
    the fullest row it still fits in, or starts a row. (Which of equally full rows it goes to
    does not change the count.)"""
    rooms: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, room in enumerate(rooms) if room >= n]
        if fits:
            rooms[min(fits, key=lambda i: rooms[i])] -= n
        else:
            rooms.append(capacity - n)
    return len(rooms)


def test_best_fit_packs_every_example_once_and_fills_the_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, size=500).tolist()
    rows = pack_rows(lengths, 256, rng.permutation(500))
    flat = sorted(i for r in rows for i in r)
    assert flat == list(range(500))
    assert all(sum(lengths[i] for i in r) <= 256 for r in rows)
    utilization = sum(lengths) / (256 * len(rows))
    assert utilization > 0.95
    assert len(rows) == best_fit_row_count(lengths, 256)


def test_a_packed_batch_has_segments_and_no_target_across_a_boundary():
    a = Example([5, 6, 7, 8], [0, 0, 1, 1])
    b = Example([9, 10, 11], [1, 1, 1])  # a mask that would train its first token
    batch = make_packed_batch([[a, b]], pad_id=0, capacity=10)
    assert batch.tokens[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 0, 0, 0]
    assert batch.segments[0].tolist() == [1, 1, 1, 1, 2, 2, 2, 0, 0, 0]
    assert batch.mask[0].tolist() == [0, 0, 1, 1, 0, 1, 1, 0, 0, 0]
    assert batch.n_targets == 4 and batch.examples == 2 and batch.n_tokens == 7
    halves = split_batch(make_packed_batch([[a], [b], [a, b]], 0, 10), 2)
    assert [h.examples for h in halves] == [2, 2]


def test_the_stream_runs_documents_on_into_the_next_row():
    docs = [
        Example(list(range(100 * k, 100 * k + n)), [0] + [1] * (n - 1))
        for k, n in enumerate([7, 5, 9])
    ]
    rows = stream_rows(docs, 8, np.arange(3))
    assert [sum(len(p.ids) for p in r) for r in rows] == [8, 8, 5]
    flat = [t for r in rows for p in r for t in p.ids]
    assert flat == [t for d in docs for t in d.ids]  # every token, in order
    masked = make_packed_batch(rows[:1], 0, 8, mask_boundary=True)
    trained = make_packed_batch(rows[:1], 0, 8, mask_boundary=False)
    # row 0: doc 0 (7 tokens) then doc 1's first token at position 7
    assert masked.mask[0, 7] == 0 and trained.mask[0, 7] == 1
    assert masked.mask[0, 0] == trained.mask[0, 0] == 0  # a row's first token never counts


@pytest.fixture(scope="module")
def model(llama_dir):
    m, _ = load_model(llama_dir)
    return m


def logits_of(model, tokens, seg=None):
    with kernel_attention(model, "chunked"), segments(None if seg is None else mx.array(seg)):
        return np.array(model(mx.array(tokens)))


def test_attention_never_crosses_segments_and_each_example_sees_only_itself(model):
    rng = np.random.default_rng(1)
    a = rng.integers(3, 60, size=11).tolist()
    b = rng.integers(3, 60, size=9).tolist()
    row = np.array([a + b + [0] * 4])
    seg = np.array([[1] * 11 + [2] * 9 + [0] * 4])
    packed = logits_of(model, row, seg)
    # b's logits are those of b alone: positions restart in effect (rotary scores are relative)
    alone = logits_of(model, np.array([b]))
    np.testing.assert_allclose(packed[0, 11:20], alone[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(
        packed[0, :11], logits_of(model, np.array([a]))[0], rtol=1e-4, atol=1e-4
    )
    # change a: b does not move; without segments it would
    other = row.copy()
    other[0, :11] = rng.integers(3, 60, size=11)
    np.testing.assert_array_equal(logits_of(model, other, seg)[0, 11:20], packed[0, 11:20])
    crossed = logits_of(model, other)[0, 11:20]
    assert np.abs(crossed - logits_of(model, row)[0, 11:20]).max() > 1e-3


def test_the_packed_loss_is_the_sum_of_the_examples_losses(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(
        data_dir,
        llama_dir,
        data={**tiny_recipe(data_dir)["data"], "packing": "pack", "pack_length": 64},
    )
    tr = Trainer(recipe_from_dict(r), tmp_path / "p", console=Console(quiet=True))
    exs = tr.train_set.examples[:6]
    packed = make_packed_batch([exs[:3], exs[3:]], tr.pad_id, 64)
    with kernel_attention(tr.model, "chunked"):
        loss_p, n_p, _ = tr.objective.loss(tr.model, tr.engine.arrays(packed))
        unpacked = make_batch(exs, tr.pad_id, 8)
        loss_u, n_u, _ = tr.objective.loss(tr.model, tr.engine.arrays(unpacked))
    assert n_p.item() == n_u.item() == sum(e.n_targets for e in exs)
    assert loss_p.item() == pytest.approx(loss_u.item(), rel=1e-5)


def test_train_on_eos_false_keeps_eos_out_of_the_loss(tokenizer):
    from mlxtune.data import Encoder

    eos = tokenizer.eos_token_id
    on = Encoder(tokenizer).encode({"text": "hello there"}, "text", "x")
    off = Encoder(tokenizer, train_on_eos=False).encode({"text": "hello there"}, "text", "x")
    assert on.ids[-1] == off.ids[-1] == eos
    assert on.mask[-1] == 1 and off.mask[-1] == 0 and on.mask[:-1] == off.mask[:-1]


def packed_recipe(data_dir, model_dir, mode="pack", **train):
    r = tiny_recipe(
        data_dir,
        model_dir,
        train={
            "batch_size": 2,
            "max_steps": 9,
            "log_every": 1,
            "progress": False,
            "seed": 3,
            **train,
        },
        eval={"every": 4, "max_batches": 2},
        checkpoints={"every": 3, "keep_last": 5},
    )
    r["data"].update(packing=mode, pack_length=64)
    return r


@pytest.mark.parametrize("mode", ["pack", "stream"])
def test_a_packed_run_learns_reports_utilization_and_resumes_exactly(
    tmp_path, data_dir, llama_dir, mode
):
    r = packed_recipe(data_dir, llama_dir, mode)

    def rows(d):
        skip = TIMING
        return [
            {k: v for k, v in json.loads(x).items() if k not in skip}
            for x in (d / "metrics.jsonl").read_text().splitlines()
        ]

    Trainer(recipe_from_dict(r), tmp_path / "whole", console=Console(quiet=True)).run()
    want = rows(tmp_path / "whole")
    steps = [x for x in want if "grad_norm" in x]
    use = [x["packing_utilization"] for x in steps]
    assert np.mean(use) > 0.85 and min(use) > 0.5  # the rows an epoch ends with are partly full
    assert steps[-1]["loss"] < steps[0]["loss"]
    crash_and_resume(r, tmp_path, 7)
    assert rows(tmp_path / "cut") == want


def test_epochs_count_packed_rows(tmp_path, data_dir, llama_dir):
    r = packed_recipe(data_dir, llama_dir, max_steps=None, epochs=1)
    tr = Trainer(recipe_from_dict(r), tmp_path / "e", console=Console(quiet=True))
    lengths = [len(e.ids) for e in tr.train_set.examples]
    # walk the stream the run trains on through its first epoch
    batches = rows = examples = tokens = 0
    for epoch, batch in tr.batches():
        if epoch > 0:
            break
        batches += 1
        assert 1 <= len(batch.lengths) <= 2 and max(batch.lengths) <= 64
        rows += len(batch.lengths)
        examples += batch.examples
        tokens += batch.n_tokens
    assert examples == len(lengths) and tokens == sum(lengths)  # every example once
    assert rows == best_fit_row_count(lengths, 64)
    assert batches == (rows + 1) // 2  # two rows a batch, the last may hold one
    assert tr.total_steps == batches < len(lengths) // 2
    # the header says rows, and the examples they hold on average (counted above)
    from mlxtune.loop.describe import header

    line = next(x for x in header(tr) if x.startswith("train"))
    per_step = tr.recipe.train.batch_size * tr.recipe.train.grad_accumulation
    assert f"{per_step} packed rows/step (about {per_step * examples / rows:.0f} examples)" in line


def test_packing_settings_are_checked(
    tmp_path, data_dir, llama_dir, model_dir_factory, tokenizer_dir
):
    r = packed_recipe(data_dir, llama_dir)
    r["data"]["pack_length"] = 16  # shorter than max_length 48
    with pytest.raises(UserInputError, match="data.pack_length: must hold the longest example"):
        recipe_from_dict(r)
    r = packed_recipe(data_dir, llama_dir)
    r["kernels"] = {"attention": "off"}
    with pytest.raises(UserInputError, match="data.packing: packed rows need"):
        recipe_from_dict(r)
    r = packed_recipe(data_dir, model_dir_factory("gemma2"))
    r["tokenizer"] = {"path": str(tokenizer_dir)}
    with pytest.raises(UserInputError, match="gemma2's attention does not go through"):
        Trainer(recipe_from_dict(r), tmp_path / "g", console=Console(quiet=True))


def test_sliding_window_layers_keep_packed_examples_apart_too(model_dir_factory):
    """mlx-lm gives a sliding-window layer an explicit mask once T exceeds the window; the
    segment ids are folded into it."""
    d = model_dir_factory(
        "llama", layer_types=("sliding_attention", "full_attention"), sliding_window=4
    )
    m, _ = load_model(d)
    rng = np.random.default_rng(2)
    a = rng.integers(3, 60, size=7).tolist()
    b = rng.integers(3, 60, size=6).tolist()
    packed = logits_of(m, np.array([a + b]), np.array([[1] * 7 + [2] * 6]))
    np.testing.assert_allclose(packed[0, 7:], logits_of(m, np.array([b]))[0], rtol=1e-4, atol=1e-4)
    crossed = logits_of(m, np.array([a + b]))[0, 7:]
    assert np.abs(crossed - packed[0, 7:]).max() > 1e-3


def test_memory_suggestions_name_the_row_length_when_packing(tmp_path, data_dir, llama_dir):
    from dataclasses import replace

    from mlxtune.memory import alternatives, estimate, shape_of

    r = packed_recipe(data_dir, llama_dir)
    r["data"].update(pack_length=1024, max_length=48)
    tr = Trainer(recipe_from_dict(r), tmp_path / "m", console=Console(quiet=True))
    s = shape_of(tr)
    assert s.length == 1023  # rows are pack_length long, whatever max_length is
    budget = estimate(replace(s, length=511))["total"] * 1.01
    fits = alternatives(s, budget, tr.recipe)
    # the longest row that fits, to 64 tokens: 512 positions fit, 576 do not
    import re

    said = [
        re.match(r"data\.pack_length: (\d+) with data\.max_length at most (\d+)", f) for f in fits
    ]
    (pack, most), *_ = [(int(m[1]), int(m[2])) for m in said if m]
    assert 512 <= pack <= 577 and most == pack
    assert not any(f.startswith("data.max_length") for f in fits)
