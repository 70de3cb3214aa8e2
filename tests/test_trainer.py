"""The training step and the run: token-weighted accumulation, the loss mask, clipping, the run
directory, checkpoints, callbacks and exports."""

import importlib.metadata
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import TIMING, tiny_recipe
from mlxtune import Callback, Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.data import make_batch
from mlxtune.errors import UserInputError

# every training row's keys: the step's, and its timings but the first step's compile time
METRIC_KEYS = {"step", "epoch", "loss", "grad_norm", "lr", "tokens_seen"} | (
    TIMING - {"first_step_compile_time_s"}
)


def make_trainer(tmp_path, data_dir, model_dir, name="run", **sections):
    r = recipe_from_dict(tiny_recipe(data_dir, model_dir, **sections))
    return Trainer(r, run_dir=tmp_path / name)


def params(trainer):
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(trainer.model.parameters())}


def test_loss_counts_exactly_the_masked_targets(tmp_path, data_dir, llama_dir):
    """No off-by-one: the loss is the sum over target positions j of -log p(ids[j] | ids[:j])."""
    tr = make_trainer(tmp_path, data_dir, llama_dir)
    exs = tr.train_set.examples[:3]
    b = make_batch(exs, tr.pad_id, 8)
    loss, n, _ = tr.objective.loss(tr.model, tr.engine.arrays(b))
    logits = np.array(tr.model(mx.array(b.tokens)).astype(mx.float32))
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    expected, count = 0.0, 0
    for i, e in enumerate(exs):
        for j in range(1, len(e.ids)):
            if e.mask[j]:
                expected -= logp[i, j - 1, e.ids[j]]
                count += 1
    assert n.item() == count == sum(e.n_targets for e in exs)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_padding_and_masked_tokens_never_move_the_loss(tmp_path, data_dir, llama_dir):
    tr = make_trainer(tmp_path, data_dir, llama_dir)
    b = make_batch(tr.train_set.examples[:4], tr.pad_id, 8)
    base, _, _ = tr.objective.loss(tr.model, tr.engine.arrays(b))
    tokens = b.tokens.copy()
    tokens[b.tokens == tr.pad_id] = 7  # change every pad
    last_prompt = [int(np.nonzero(m)[0][0]) - 1 for m in b.mask]
    for i, j in enumerate(last_prompt):
        tokens[i, j + 2 :][b.mask[i, j + 2 :] == 0] = 9  # and padding after the answer
    moved, _, _ = tr.objective.loss(
        tr.model, {"tokens": mx.array(tokens), "mask": mx.array(b.mask)}
    )
    assert moved.item() == pytest.approx(base.item(), rel=1e-6)
    # ...while a target token does move it
    tokens = b.tokens.copy()
    i, j = 0, int(np.nonzero(b.mask[0])[0][-1])
    tokens[i, j] = (tokens[i, j] + 1) % 20
    changed, _, _ = tr.objective.loss(
        tr.model, {"tokens": mx.array(tokens), "mask": mx.array(b.mask)}
    )
    assert abs(changed.item() - base.item()) > 1e-4


def test_grad_accumulation_is_weighted_by_valid_tokens(tmp_path, data_dir, llama_dir):
    sgd = {"name": "sgd", "lr": 0.5, "momentum": 0.0, "grad_clip": None}
    a = make_trainer(tmp_path, data_dir, llama_dir, "a", optimizer=sgd)
    b = make_trainer(tmp_path, data_dir, llama_dir, "b", optimizer=sgd)
    exs = a.train_set.examples
    short = [e for e in exs if e.n_targets == min(x.n_targets for x in exs)][:2]
    long = [e for e in exs if e.n_targets == max(x.n_targets for x in exs)][:2]
    assert sum(e.n_targets for e in short) != sum(e.n_targets for e in long)
    b.model.update(a.model.parameters())  # same start
    a.engine.step([make_batch(short, a.pad_id, 8), make_batch(long, a.pad_id, 8)])
    b.engine.step([make_batch(short + long, b.pad_id, 8)])
    pa, pb = params(a), params(b)
    moved = [k for k in pa if k.endswith("lora_b")]
    assert moved and all(np.abs(pa[k]).max() > 0 for k in moved)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-4, atol=1e-6)


def test_grad_norm_is_reported_and_clipping_caps_the_update(tmp_path, data_dir, llama_dir):
    sgd = {"name": "sgd", "lr": 1.0, "momentum": 0.0}
    free = make_trainer(tmp_path, data_dir, llama_dir, "free", optimizer={**sgd, "grad_clip": None})
    clip = make_trainer(tmp_path, data_dir, llama_dir, "clip", optimizer={**sgd, "grad_clip": 1e-3})
    clip.model.update(free.model.parameters())
    start = params(free)
    batch = make_batch(free.train_set.examples[:8], free.pad_id, 8)
    norm_free = free.engine.step([batch]).norm
    norm_clip = clip.engine.step([batch]).norm
    assert norm_free.item() == pytest.approx(norm_clip.item(), rel=1e-5)  # reported before clipping
    step_free = np.sqrt(sum(((params(free)[k] - start[k]) ** 2).sum() for k in start))
    step_clip = np.sqrt(sum(((params(clip)[k] - start[k]) ** 2).sum() for k in start))
    assert step_free == pytest.approx(
        norm_free.item(), rel=1e-3
    )  # SGD, lr 1: the step is the gradient
    assert step_clip == pytest.approx(1e-3, rel=1e-3)


def test_lora_run_end_to_end(tmp_path, data_dir, llama_dir):
    tr = make_trainer(
        tmp_path,
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 12, "log_every": 3, "progress": False},
        eval={"every": 4},
        samples={"every": 6, "count": 2, "max_new_tokens": 4},
        checkpoints={"every": 4, "keep_last": 2},
        export={"formats": ["mlx-lm"]},
    )
    base = {k: v for k, v in params(tr).items() if "lora" not in k}
    summary = tr.run()
    rd = tmp_path / "run"
    for name in (
        "recipe.yaml",
        "config_resolved.json",
        "metrics.jsonl",
        "samples.jsonl",
        "log.txt",
        "summary.json",
    ):
        assert (rd / name).exists(), name
    rows = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train_rows] == [3, 6, 9, 12]
    assert all(METRIC_KEYS <= set(r) for r in train_rows)
    assert "first_step_compile_time_s" in train_rows[0]
    assert [r["step"] for r in eval_rows] == [4, 8, 12]
    assert all(r["eval_ppl"] == pytest.approx(np.exp(r["eval_loss"])) for r in eval_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert train_rows[-1]["tokens_seen"] == summary["tokens_seen"] > 0
    # checkpoints: the last two step-* kept, plus best and final
    ckpts = sorted(p.name for p in (rd / "checkpoints").iterdir())
    assert ckpts == ["best", "final", "step-000008", "step-000012"]
    meta = mx.load(
        str(rd / "checkpoints" / "final" / "adapters.safetensors"), return_metadata=True
    )[1]
    assert meta["step"] == "12" and {"loss", "lr", "time"} <= set(meta)
    resolved = json.loads((rd / "config_resolved.json").read_text())
    derived = resolved["derived"]
    assert derived["effective_steps"] == 12 and 0 < derived["trainable_percent"] < 100
    # what the run's numbers were made with, as the installed packages' metadata says
    for package in ("mlxtune", "mlx", "mlx-lm", "mlx-vlm"):
        assert resolved["versions"][package] == importlib.metadata.version(package), package
    samples = [json.loads(line) for line in (rd / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [6, 6, 12, 12]
    # only the adapters trained
    after = params(tr)
    for k, v in base.items():
        np.testing.assert_array_equal(after[k], v)
    assert summary["best_eval_loss"] == min(r["eval_loss"] for r in eval_rows)


def test_mlx_lm_export_loads_in_mlx_lm_with_the_same_logits(tmp_path, data_dir, llama_dir):
    from mlx_lm.utils import load as mlx_lm_load

    tr = make_trainer(
        tmp_path,
        data_dir,
        llama_dir,
        adapter={
            "type": "lora",
            "rank": 4,
            "alpha": 8,
            "targets": ["q_proj", "v_proj"],
            "layers": 1,
        },
        export={"formats": ["mlx-lm"]},
    )
    tr.run()
    model, _ = mlx_lm_load(str(llama_dir), adapter_path=str(tmp_path / "run" / "export" / "mlx-lm"))
    x = mx.array([tr.train_set.examples[0].ids])
    tr.model.eval()
    np.testing.assert_allclose(np.array(model(x)), np.array(tr.model(x)), rtol=1e-4, atol=1e-4)


def test_training_from_scratch_saves_a_loadable_model(tmp_path, data_dir):
    r = tiny_recipe(
        data_dir,
        model={
            "arch": {
                "model_type": "llama",
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
                "num_attention_heads": 2,
                "rms_norm_eps": 1e-5,
            }
        },
        tokenizer={"train": {"vocab_size": 40, "model_type": "char"}},
        adapter={"type": "full"},
        export={"formats": ["fused"]},
    )
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / "scratch")
    tr.run()
    out = tmp_path / "scratch" / "export" / "fused"
    from mlx_lm.utils import load as mlx_lm_load
    from transformers import AutoConfig, AutoTokenizer

    model, tok = mlx_lm_load(str(out))
    x = mx.array([tr.train_set.examples[0].ids])
    np.testing.assert_allclose(np.array(model(x)), np.array(tr.model(x)), rtol=1e-5, atol=1e-5)
    assert AutoConfig.from_pretrained(out).model_type == "llama"
    hf_tok = AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode("reverse abc =") == list(tok.encode("reverse abc ="))
    # a later recipe can start from it
    r2 = tiny_recipe(data_dir, out)
    Trainer(recipe_from_dict(r2), run_dir=tmp_path / "again", dry_run=False)


def test_callback_can_save_and_stop(tmp_path, data_dir, llama_dir):
    seen = []

    class Steer(Callback):
        def on_step(self, trainer, event):
            seen.append(event.step)
            if event.step == 2:
                trainer.request_save()
            if event.step == 3:
                trainer.request_stop()

    r = recipe_from_dict(
        tiny_recipe(
            data_dir,
            llama_dir,
            train={"batch_size": 8, "max_steps": 50, "log_every": 1, "progress": False},
        )
    )
    summary = Trainer(r, run_dir=tmp_path / "cb", callbacks=[Steer()]).run()
    assert seen == [1, 2, 3] and summary["steps"] == 3
    assert (tmp_path / "cb" / "checkpoints" / "step-000002" / "adapters.safetensors").exists()
    assert (tmp_path / "cb" / "checkpoints" / "final").exists()


def test_function_callbacks_see_every_step(tmp_path, data_dir, llama_dir):
    losses = []
    r = tiny_recipe(data_dir, llama_dir)
    r["train"]["log_every"] = 1
    Trainer(
        recipe_from_dict(r),
        run_dir=tmp_path / "fn",
        callbacks=[lambda trainer, ev: losses.append(ev.loss)],
    ).run()
    rows = (tmp_path / "fn" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(x)["loss"] for x in rows if "grad_norm" in json.loads(x)]
    # each step's own loss, as the run logs it
    assert len(losses) == len(logged) == 6
    np.testing.assert_allclose(losses, logged, rtol=1e-6)


def test_grad_accumulation_run_and_epochs(tmp_path, data_dir, llama_dir):
    r = recipe_from_dict(
        tiny_recipe(
            data_dir,
            llama_dir,
            train={
                "batch_size": 4,
                "grad_accumulation": 2,
                "epochs": 1,
                "log_every": 4,
                "progress": False,
            },
        )
    )
    tr = Trainer(r, run_dir=tmp_path / "acc")
    assert tr.total_steps == 12  # 96 examples / 4 per batch / 2 per step
    summary = tr.run()
    assert summary["steps"] == 12


def test_dry_run_compiles_one_step_and_writes_nothing(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    p = tmp_path / "r.yaml"
    import yaml

    p.write_text(yaml.safe_dump(tiny_recipe(data_dir, llama_dir)))
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(p), "--dry-run"]) == 0
    assert "dry run: one step compiled" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_existing_run_dir_is_refused_and_untouched(tmp_path, data_dir, llama_dir):
    tr = make_trainer(tmp_path, data_dir, llama_dir, "same")
    tr.run()
    before = (tmp_path / "same" / "metrics.jsonl").read_text()
    with pytest.raises(UserInputError, match="already holds a run"):
        make_trainer(tmp_path, data_dir, llama_dir, "same")
    assert (tmp_path / "same" / "metrics.jsonl").read_text() == before


def test_run_dir_paths_cannot_escape(tmp_path):
    from mlxtune.runs.rundir import RunDir

    rd = RunDir(tmp_path / "r")
    assert rd.inside("checkpoints", "final") == (tmp_path / "r" / "checkpoints" / "final").resolve()
    with pytest.raises(UserInputError, match="outside the run directory"):
        rd.inside("..", "elsewhere")
    with pytest.raises(UserInputError, match="outside the run directory"):
        rd.inside("/etc/passwd")


@pytest.mark.parametrize(
    "adapter, model, train",
    [
        (
            {"type": "dora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]},
            {},
            {},
        ),
        (
            {"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"], "dropout": 0.1},
            {"dtype": "bfloat16"},
            {},
        ),
        ({"type": "full"}, {}, {"label_smoothing": 0.1}),
    ],
    ids=["dora", "lora-bf16-dropout", "full-label-smoothing"],
)
def test_adapter_kinds_dtypes_and_smoothing_train(
    tmp_path, data_dir, llama_dir, adapter, model, train
):
    r = tiny_recipe(data_dir, llama_dir, adapter=adapter)
    r["model"].update(model)
    r["train"].update(train)
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / "k")
    start = params(tr)
    summary = tr.run()
    assert np.isfinite(summary["final_loss"])
    moved = [k for k, v in params(tr).items() if not np.array_equal(v, start[k])]
    trainable = {k for k, _ in tree_flatten(tr.model.trainable_parameters())}
    assert moved and set(moved) <= trainable
    weights = mx.load(str(tmp_path / "k" / "checkpoints" / "final" / "adapters.safetensors"))
    assert set(weights) == trainable


def test_every_logged_row_has_a_throughput(tmp_path, data_dir, llama_dir):
    r = recipe_from_dict(
        tiny_recipe(
            data_dir,
            llama_dir,
            train={"batch_size": 8, "max_steps": 3, "log_every": 1, "progress": False},
        )
    )
    tr = Trainer(r, run_dir=tmp_path / "t")
    tr.run()
    rows = [row for row in tr.run_dir.read_jsonl("metrics.jsonl") if "loss" in row]
    assert len(rows) == 3 and all(
        row["tokens_per_sec"] > 0 and row["step_time_s"] > 0 for row in rows
    )


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path):
    from mlxtune.runs.rundir import RunDir

    rd = RunDir(tmp_path / "r")
    with rd.staged("checkpoints", "best") as d:
        (d / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with rd.staged("checkpoints", "best") as d:
            (d / "a.txt").write_text("second, half-written")
            raise RuntimeError("disk full")
    assert (tmp_path / "r" / "checkpoints" / "best" / "a.txt").read_text() == "first"
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["best"]
    with rd.staged("checkpoints", "best") as d:
        (d / "a.txt").write_text("third")
    assert (tmp_path / "r" / "checkpoints" / "best" / "a.txt").read_text() == "third"


def test_the_loss_is_told_whether_the_head_trains(tmp_path, data_dir, llama_dir):
    lora = make_trainer(tmp_path, data_dir, llama_dir, "lora")
    full = make_trainer(tmp_path, data_dir, llama_dir, "full", adapter={"type": "full"})
    assert lora.built.components.head_trains is False and full.built.components.head_trains is True


@pytest.mark.parametrize(
    "section,via_env",
    [("loss", False), ("attention", False), ("loss", True)],
)
def test_a_kernel_tier_this_machine_lacks_is_refused(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch, section, via_env
):
    import yaml

    from mlxtune.kernels import IMPLS

    # no machine has both GPU backends, so one of them is always missing
    missing = next(t for t in ("cuda", "metal") if t not in IMPLS)
    kernels, env, key = {section: missing}, None, f"kernels.{section}"
    if via_env:
        kernels, env = {}, missing
    if env:
        monkeypatch.setenv("MLXTUNE_KERNELS", env)
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(tiny_recipe(data_dir, llama_dir, kernels=kernels)))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert key in err and "backend" in err and "Traceback" not in err


def test_a_crash_between_the_renames_puts_the_old_checkpoint_back(tmp_path):
    from mlxtune.runs.rundir import RunDir

    rd = RunDir(tmp_path / "r")
    with rd.staged("checkpoints", "step-000003") as d:
        (d / "a.txt").write_text("good")
    ckpts = tmp_path / "r" / "checkpoints"
    (ckpts / "step-000003").rename(ckpts / ".step-000003.old")  # the state such a crash leaves
    with pytest.raises(RuntimeError):
        with rd.staged("checkpoints", "step-000003") as d:
            raise RuntimeError("killed again")
    assert (ckpts / "step-000003" / "a.txt").read_text() == "good"


def test_each_row_logs_the_learning_rate_its_step_used(tmp_path, data_dir, llama_dir):
    """A linear decay from 1e-2 to 1e-3 over 5 steps: step s (1-based) runs at the rate of
    schedule step s-1, and so do its row, its event and its checkpoint."""
    seen = {}
    r = tiny_recipe(
        data_dir,
        llama_dir,
        optimizer={"lr": 1e-2},
        schedule={"name": "linear", "warmup_steps": 0, "min_lr": 1e-3},
        train={"batch_size": 4, "max_steps": 5, "log_every": 1, "progress": False},
        eval={"every": None},
        checkpoints={"every": 2},
    )
    cb = lambda trainer, event: seen.__setitem__(event.step, event.lr)  # noqa: E731
    Trainer(recipe_from_dict(r), tmp_path / "r", callbacks=[cb], console=Console(quiet=True)).run()
    want = {s: 1e-2 + (1e-3 - 1e-2) * (s - 1) / 4 for s in range(1, 6)}
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = {x["step"]: x["lr"] for x in rows if "grad_norm" in x}
    assert logged == pytest.approx(want, rel=1e-6) and seen == pytest.approx(want, rel=1e-6)
    meta = json.loads((tmp_path / "r/checkpoints/step-000004/trainer_state.json").read_text())
    assert meta["lr"] == pytest.approx(want[4], rel=1e-6)


def test_the_run_log_names_keys_that_have_no_effect(tmp_path, data_dir, llama_dir):
    r = tiny_recipe(
        data_dir, llama_dir, optimizer={"lr": 1e-2, "momentum": 0.5}, train={"max_steps": 1}
    )
    Trainer(recipe_from_dict(r), tmp_path / "r", console=Console(quiet=True)).run()
    log = (tmp_path / "r" / "log.txt").read_text()
    assert "note: optimizer.momentum has no effect" in log
    assert "optimizer.lr has no effect" not in log
