"""Mixed precision: fp32 master weights, dynamic loss scaling, and non-finite steps (stop or
skip), including exact resume of a float16 run."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import conftest
from conftest import TIMING, make_crash, tiny_recipe
from mlxtune import Callback, Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.engine.precision import update_scale
from mlxtune.errors import TrainingError
from mlxtune.runs.checkpoint import verify


def trainer(data_dir, model_dir, run_dir, dtype="float32", callbacks=(), resume=None, **sections):
    r = tiny_recipe(data_dir, model_dir, **sections)
    r.setdefault("model", {})["dtype"] = dtype
    return Trainer(
        recipe_from_dict(r),
        run_dir=run_dir,
        console=Console(quiet=True),
        callbacks=callbacks,
        resume=resume,
    )


def strict_rows(run_dir):
    """metrics.jsonl parsed as strict JSON (a NaN or Infinity in it fails)."""

    def refuse(name):
        raise AssertionError(f"metrics.jsonl holds {name}")

    return [
        json.loads(line, parse_constant=refuse)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def trainable(tr):
    return {
        k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(tr.model.trainable_parameters())
    }


FULL = {"type": "full"}


def test_dynamic_scale_grows_after_its_interval_and_backs_off_on_overflow():
    s = {"scale": mx.array(1024.0), "good": mx.array(0, dtype=mx.int32)}
    seen = []
    for ok in [True, True, True, False, True, False, False]:
        update_scale(s, mx.array(ok), growth=2.0, backoff=0.5, interval=3, min_scale=200.0)
        seen.append((s["scale"].item(), s["good"].item()))
    assert seen == [
        (1024.0, 1),
        (1024.0, 2),
        (2048.0, 0),  # three finite steps in a row: grow
        (1024.0, 0),  # overflow: back off, count again
        (1024.0, 1),
        (512.0, 0),
        (256.0, 0),
    ]
    update_scale(s, mx.array(False), 2.0, 0.5, 3, 200.0)
    assert s["scale"].item() == 200.0  # never below min_scale


def test_bf16_full_finetune_updates_fp32_masters_that_pure_bf16_would_round_away(
    tmp_path, data_dir, llama_dir
):
    """An Adam step of 1e-5 is below bfloat16's resolution for these weights: with master
    weights it accumulates in fp32; without them the weights do not move."""
    opt = {"name": "adam", "lr": 1e-5, "grad_clip": None}
    train = {"batch_size": 8, "max_steps": 3, "log_every": 1, "progress": False}
    ev = {"every": None, "max_batches": 1}
    kw = dict(adapter=FULL, optimizer=opt, schedule={"name": "constant"}, train=train, eval=ev)
    with_m = trainer(data_dir, llama_dir, tmp_path / "m", "bfloat16", **kw)
    plain = trainer(
        data_dir, llama_dir, tmp_path / "p", "bfloat16", precision={"master_weights": False}, **kw
    )
    assert plain.engine.masters is None
    start = trainable(with_m)
    with_m.run()
    plain.run()
    k = "model.layers.0.mlp.up_proj.weight"
    masters = dict(tree_flatten(with_m.engine.masters))
    assert masters[k].dtype == mx.float32
    assert dict(tree_flatten(with_m.model.parameters()))[k].dtype == mx.bfloat16
    moved = np.abs(np.array(masters[k]) - start[k])
    assert np.median(moved) > 2e-5  # three steps of ~1e-5 each, kept in fp32
    # the model computes with the masters rounded to bfloat16
    np.testing.assert_array_equal(
        trainable(with_m)[k], np.array(masters[k].astype(mx.bfloat16).astype(mx.float32))
    )
    # the optimizer's state is fp32
    state = dict(tree_flatten(with_m.optimizer.state))
    assert state[k.replace(".weight", ".weight.v")].dtype == mx.float32
    # pure bfloat16: almost every update of 1e-5 rounds away
    plain_moved = np.abs(trainable(plain)[k] - start[k])
    assert np.mean(plain_moved > 0) < 0.2 < np.mean(moved > 0)


def test_lora_adapters_are_fp32_already_and_need_no_master_copy(tmp_path, data_dir, llama_dir):
    tr = trainer(data_dir, llama_dir, tmp_path / "l", "bfloat16")
    assert tr.engine.masters is None
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(tr.model.trainable_parameters()))


def test_bf16_with_masters_tracks_the_fp32_run(tmp_path, data_dir, llama_dir):
    kw = dict(
        adapter=FULL,
        optimizer={"lr": 3e-3},
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False},
        eval={"every": None},
    )
    trainer(data_dir, llama_dir, tmp_path / "32", **kw).run()
    trainer(data_dir, llama_dir, tmp_path / "16", "bfloat16", **kw).run()
    a = [r["loss"] for r in strict_rows(tmp_path / "32") if "grad_norm" in r]
    b = [r["loss"] for r in strict_rows(tmp_path / "16") if "grad_norm" in r]
    assert a[-1] < a[0] - 0.2  # it learns
    np.testing.assert_allclose(b, a, rtol=3e-2)


class Record(Callback):
    def __init__(self):
        self.weights, self.skipped = {}, {}

    def on_step(self, trainer, event):
        self.weights[event.step] = trainable(trainer)
        self.skipped[event.step] = trainer.engine.skipped


def test_float16_dynamic_scaling_skips_overflowing_steps_and_settles(tmp_path, data_dir, llama_dir):
    rec = Record()
    tr = trainer(
        data_dir,
        llama_dir,
        tmp_path / "f16",
        "float16",
        callbacks=[rec],
        adapter=FULL,
        optimizer={"lr": 3e-3},
        train={"batch_size": 8, "max_steps": 12, "log_every": 1, "progress": False},
        eval={"every": None},
        precision={"init_scale": 2.0**20, "growth_interval": 3},
    )
    assert tr.scaling == "dynamic"  # auto: dynamic for float16
    tr.run()
    rows = [r for r in strict_rows(tmp_path / "f16") if "grad_norm" in r]
    scales = [r["loss_scale"] for r in rows]
    assert scales[0] < 2.0**20  # the first step overflowed and the scale backed off
    assert any(b > a for a, b in zip(scales, scales[1:], strict=False))  # and grew back
    skips = [s for s in range(1, 13) if rec.skipped[s] > rec.skipped.get(s - 1, 0)]
    assert skips and rows[-1]["skipped_steps"] == len(skips)
    for s in skips:  # a skipped step changed no weight
        before = rec.weights.get(s - 1) or rec.weights[s]  # (step 1: compared to itself)
        for k in before:
            np.testing.assert_array_equal(rec.weights[s][k], before[k])
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    assert losses[-1] < losses[0] - 0.3


class Poison(conftest.Poison):
    """conftest's Poison, recording the trainable weights after every step."""

    def __init__(self, at, until=None):
        super().__init__(at, until)
        self.weights = {}

    def on_step(self, trainer, event):
        self.weights[event.step] = trainable(trainer)
        super().on_step(trainer, event)


def test_a_nan_stops_the_run_and_leaves_the_last_checkpoint_intact(tmp_path, data_dir, llama_dir):
    run = tmp_path / "nan"
    with pytest.raises(TrainingError) as e:
        trainer(
            data_dir,
            llama_dir,
            run,
            callbacks=[Poison(at=5)],
            train={"batch_size": 8, "max_steps": 10, "log_every": 1, "progress": False},
            checkpoints={"every": 2},
        ).run()
    msg = str(e.value)
    assert "step 6: the loss became nan" in msg and "checkpoints/step-000004" in msg
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["best", "step-000002", "step-000004"]  # nothing written for the bad step
    for c in ckpts:
        assert verify(run / "checkpoints" / c) is None
    steps = [r["step"] for r in strict_rows(run) if "grad_norm" in r]
    assert steps == [1, 2, 3, 4, 5]


def test_skip_drops_the_bad_update_and_goes_on(tmp_path, data_dir, llama_dir):
    run = tmp_path / "skip"
    poison = Poison(at=3, until=4)
    tr = trainer(
        data_dir,
        llama_dir,
        run,
        callbacks=[poison],
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False},
        precision={"nonfinite": "skip"},
    )
    summary = tr.run()
    assert summary["steps"] == 8
    for k, v in poison.weights[3].items():  # step 4 changed nothing
        np.testing.assert_array_equal(poison.weights[4][k], v)
    assert any(np.any(poison.weights[5][k] != v) for k, v in poison.weights[4].items())
    rows = {r["step"]: r for r in strict_rows(run) if "grad_norm" in r}
    assert rows[4]["loss"] is None and rows[4]["grad_norm"] is None  # only a skipped step
    assert rows[3].get("skipped_steps") is None and rows[8]["skipped_steps"] == 1
    assert rows[8]["tokens_seen"] < summary["tokens_seen"] + 1
    assert "step 4: the loss became nan; update skipped" in (run / "log.txt").read_text()


def test_skip_stops_after_max_skipped_in_a_row(tmp_path, data_dir, llama_dir):
    with pytest.raises(TrainingError, match=r"step 6: the loss became nan \(3 steps in a row\)"):
        trainer(
            data_dir,
            llama_dir,
            tmp_path / "many",
            callbacks=[Poison(at=3)],
            train={"batch_size": 8, "max_steps": 10, "log_every": 1, "progress": False},
            precision={"nonfinite": "skip", "max_skipped": 2},
        ).run()


def test_a_float16_run_with_masters_and_scaling_resumes_exactly(tmp_path, data_dir, llama_dir):
    kw = dict(
        adapter=FULL,
        optimizer={"lr": 3e-3},
        train={"batch_size": 8, "max_steps": 10, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 4, "max_batches": 1},
        checkpoints={"every": 3, "keep_last": 5},
        precision={"init_scale": 2.0**24, "growth_interval": 3},
    )
    trainer(data_dir, llama_dir, tmp_path / "whole", "float16", **kw).run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer(
            data_dir, llama_dir, tmp_path / "cut", "float16", callbacks=[make_crash(7)], **kw
        ).run()
    assert (tmp_path / "cut" / "checkpoints" / "step-000006" / "masters.safetensors").exists()
    trainer(data_dir, llama_dir, tmp_path / "cut", "float16", resume="latest", **kw).run()

    def rows(d):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in strict_rows(d)]

    want = rows(tmp_path / "whole")
    assert any(r.get("skipped_steps") for r in want)  # the scaler was exercised
    assert rows(tmp_path / "cut") == want


class PoisonAndState(Poison):
    """Poison, also recording the optimizer's state (as fp32) after every step."""

    def __init__(self, at, until=None):
        super().__init__(at, until)
        self.state = {}

    def on_step(self, trainer, event):
        mx.eval(trainer.optimizer.state)
        self.state[event.step] = {
            k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(trainer.optimizer.state)
        }
        super().on_step(trainer, event)


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param({"name": "lion", "lr": 1e-3}, marks=pytest.mark.slow),  # suite time
        pytest.param(
            {"name": "adafactor", "lr": 1e-2, "adafactor": {"beta1": 0.9}}, marks=pytest.mark.slow
        ),
        {"name": "muon", "lr": 1e-3},
        {"name": "sophia", "lr": 1e-3, "sophia": {"k": 2}},
        {"name": "adamw8bit", "lr": 1e-2},
    ],
    ids=lambda o: o["name"],
)
def test_every_optimizer_trains_16_bit_weights_through_a_skipped_step(
    tmp_path, data_dir, llama_dir, optimizer, monkeypatch
):
    """float16 weights with fp32 masters and a dynamic loss scale, two micro-batches a step,
    clipping: a step made NaN changes no weight, master or optimizer state, and the run goes
    on to train."""
    import mlxtune.engine.optim

    monkeypatch.setattr(
        mlxtune.engine.optim, "MIN_8BIT", 512
    )  # adamw8bit: the tiny matrices in 8 bits
    poison = PoisonAndState(at=3, until=4)
    tr = trainer(
        data_dir,
        llama_dir,
        tmp_path / "run",
        "float16",
        [poison],
        adapter=FULL,
        optimizer={**optimizer, "grad_clip": 0.5, "weight_decay": 0.1},
        train={
            "batch_size": 4,
            "grad_accumulation": 2,
            "max_steps": 6,
            "log_every": 1,
            "progress": False,
        },
        precision={"nonfinite": "skip"},
        eval={"every": None, "max_batches": 1},
    )
    assert tr.engine.masters is not None and tr.engine.scaling == "dynamic"
    summary = tr.run()
    assert summary["steps"] == 6
    for k, v in poison.weights[3].items():  # step 4 changed nothing
        np.testing.assert_array_equal(poison.weights[4][k], v)
    for k, v in poison.state[3].items():
        np.testing.assert_array_equal(poison.state[4][k], v, err_msg=k)
    assert any(np.any(poison.weights[6][k] != v) for k, v in poison.weights[4].items())
    rows = {r["step"]: r for r in strict_rows(tmp_path / "run") if "grad_norm" in r}
    assert rows[4]["loss"] is None and rows[6]["skipped_steps"] == 1 and rows[6]["loss"] > 0
    if optimizer["name"] == "adamw8bit":
        assert any(k.endswith(".m_q") for k in poison.state[6])
