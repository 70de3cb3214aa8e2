"""NEFTune (``train.neftune_noise_alpha``): uniform noise on the token embeddings while an SFT run
trains, of at most alpha / sqrt(T x D); evaluation, generation and exports see none."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from conftest import tiny_arch, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.models import add_embedding_noise, dropout_key


def tiny_llama():
    mx.random.seed(0)
    args = llama.ModelArgs.from_dict({**tiny_arch("llama"), "vocab_size": 50})
    return llama.Model(args)


def test_the_noise_is_uniform_within_its_bound_while_training_only():
    model, alpha = tiny_llama(), 5.0
    emb = add_embedding_noise(model, alpha)
    ids = np.random.default_rng(0).integers(0, 50, (6, 40))
    table = np.array(model.model.embed_tokens.weight, np.float64)
    bound = alpha / np.sqrt(40 * 32)  # T = 40 positions, D = 32
    model.train()
    mx.random.seed(1)
    first = np.array(emb(mx.array(ids)), np.float64)
    noise = first - table[ids]
    n = noise.size
    assert np.abs(noise).max() <= bound * (1 + 1e-5)
    assert np.abs(noise).max() > 0.99 * bound  # 7,680 draws reach the edge
    assert abs(noise.mean()) < 4 * bound / np.sqrt(3 * n)
    assert noise.var() == pytest.approx(bound**2 / 3, rel=0.05)  # U(-b, b): b^2 / 3
    again = np.array(emb(mx.array(ids)), np.float64)
    assert np.abs(again - first).max() > 0.5 * bound  # fresh draws each forward
    model.eval()
    assert np.array_equal(np.array(emb(mx.array(ids)), np.float64), table[ids])


def test_the_noise_comes_from_the_forward_contexts_key():
    """Data-parallel ranks draw from keys of their own (the engine's dropout key)."""
    model = tiny_llama()
    emb = add_embedding_noise(model, 5.0)
    model.train()
    ids = mx.array([[1, 2, 3, 4]])

    def draw(k):
        with dropout_key(mx.random.key(k)):
            return np.array(emb(ids))

    assert np.array_equal(draw(3), draw(3))
    assert not np.allclose(draw(3), draw(4))


def run(tmp_path, data_dir, llama_dir, name, alpha, **extra):
    train = {"batch_size": 8, "max_steps": 4, "log_every": 1, "progress": False}
    if alpha is not None:
        train["neftune_noise_alpha"] = alpha
    r = tiny_recipe(data_dir, llama_dir, train=train, eval={"every": 2, "at_start": True}, **extra)
    out = tmp_path / name
    Trainer(recipe_from_dict(r), out, console=Console(quiet=True)).run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, (out / "log.txt").read_text()


def test_an_sft_run_trains_on_noisy_embeddings_and_evaluates_on_clean_ones(
    tmp_path, data_dir, llama_dir, capsys
):
    plain, _ = run(tmp_path, data_dir, llama_dir, "plain", None)
    noisy, log = run(tmp_path, data_dir, llama_dir, "noisy", 50.0)
    # the last evaluation, after steps were traced with noise, as `mlxtune eval` computes it
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "noisy"), "--json"]) == 0
    trained = json.loads(capsys.readouterr().out)["models"]["trained"]
    last = [r["eval_loss"] for r in noisy if "eval_loss" in r][-1]
    assert trained["eval_loss"] == pytest.approx(last, rel=1e-5)
    assert "NEFTune" in log
    start = [r["eval_loss"] for r in (plain[0], noisy[0]) if r["step"] == 0]
    assert len(start) == 2 and start[0] == pytest.approx(start[1], rel=1e-6)  # no noise in eval
    loss = {k: [r["loss"] for r in rows if "loss" in r] for k, rows in (("p", plain), ("n", noisy))}
    assert loss["p"][0] != pytest.approx(loss["n"][0], rel=1e-4)  # the same batch, noisy inputs


def test_neftune_is_refused_below_zero_and_noted_outside_sft(tmp_path, capsys):
    from test_recipe import recipe_text, validate_notes

    notes = validate_notes(
        tmp_path,
        capsys,
        recipe_text(train={"max_steps": 10, "neftune_noise_alpha": 5}, objective={"type": "dpo"}),
    )
    assert "NEFTune is for SFT" in notes["train.neftune_noise_alpha"]
    notes = validate_notes(tmp_path, capsys, recipe_text(train={"neftune_noise_alpha": 5}))
    assert "train.neftune_noise_alpha" not in notes
    p = tmp_path / "bad.yaml"
    p.write_text(recipe_text(train={"neftune_noise_alpha": -1}))
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert "train.neftune_noise_alpha: must be greater than 0" in err and "Traceback" not in err


def test_a_resumed_run_draws_the_same_noise(tmp_path, data_dir, llama_dir):
    from conftest import crash_and_resume

    r = tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": 4, "log_every": 1, "progress": False},
        eval={"every": None},
        checkpoints={"every": 2},
    )
    r["train"]["neftune_noise_alpha"] = 50.0

    def rows(d):
        out = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in out if "loss" in r]

    Trainer(recipe_from_dict(r), tmp_path / "whole", console=Console(quiet=True)).run()
    crash_and_resume(r, tmp_path, 2)
    assert rows(tmp_path / "cut") == rows(tmp_path / "whole")
