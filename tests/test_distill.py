"""Distillation from a teacher: each mode's loss against its formula written here over both
models' full logits (float64 values, MLX gradients); top-k against the full KL when k covers
the vocabulary; GKD's ends against forward and reverse KL; the teacher's precomputed top-k
against the live teacher; exact resume with drawn completions; the memory plan counting the
teacher; refusals; and learning on the shipped quickstart-distill task."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import yaml
from mlx.utils import tree_flatten

from conftest import (
    REPO,
    make_crash,
    objective_recipe,
    reverse_rows,
    same_gradients,
    same_rows,
    shake_adapters,
    shipped_recipe,
    tiny_arch,
    write_jsonl,
)
from conftest import build_run as build
from conftest import run_rows as rows
from mlxtune import Trainer, recipe_from_dict
from mlxtune.cli import main
from mlxtune.console import Console
from mlxtune.memory import estimate, shape_of
from mlxtune.objectives.distill import topk_kl


@pytest.fixture
def teacher_dir(model_dir_factory):
    """Another tiny llama with the student's tokenizer (wider MLP, other weights)."""
    return model_dir_factory("llama", intermediate_size=96)


@pytest.fixture
def prompts(tmp_path):
    d = tmp_path / "prompts"
    rng = np.random.default_rng(0)
    for name, n in (("train", 24), ("valid", 6)):
        words = ["".join(rng.choice(list("abcdefgh"), rng.integers(3, 6))) for _ in range(n)]
        write_jsonl(
            d / f"{name}.jsonl", [{"prompt": f"reverse {w} =", "answer": w[::-1]} for w in words]
        )
    return d


def recipe(data_dir, student, teacher, objective, **over):
    return objective_recipe(
        "distill",
        student,
        data_dir,
        {"type": "distill", "teacher": str(teacher), **objective},
        **over,
    )


def log_softmax64(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def targets_of(batch):
    """(row, position, label) of every target: position j reads token j + 1."""
    out = []
    for r in range(len(batch.tokens)):
        for j in np.flatnonzero(batch.mask[r, 1:] > 0):
            out.append((r, int(j), int(batch.tokens[r, j + 1])))
    return out


def logits64(model, batch):
    return np.array(model(mx.array(batch.tokens[:, :-1])).astype(mx.float32), dtype=np.float64)


# ------------------------------------------------------------------------ the divergences
def test_topk_kl_over_every_token_is_the_full_kl_and_buckets_the_rest():
    rng = np.random.default_rng(0)
    zt, zs = rng.normal(0, 2, (5, 11)), rng.normal(0, 2, (5, 11))
    lt, ls = log_softmax64(zt), log_softmax64(zs)
    full = (np.exp(lt) * (lt - ls)).sum(-1)
    order = np.argsort(-lt, axis=-1)
    got = topk_kl(
        mx.array(np.take_along_axis(lt, order, -1), mx.float32),
        mx.array(np.take_along_axis(ls, order, -1), mx.float32),
    )
    np.testing.assert_allclose(np.array(got), full, rtol=1e-4, atol=1e-6)
    k = 3  # the teacher's top 3 and one bucket for the other 8 tokens, on both sides
    top = order[:, :k]
    pt, ps = np.exp(np.take_along_axis(lt, top, -1)), np.exp(np.take_along_axis(ls, top, -1))
    rt, rs = 1 - pt.sum(-1), 1 - ps.sum(-1)
    want = (pt * np.log(pt / ps)).sum(-1) + rt * np.log(rt / rs)
    got = topk_kl(mx.array(np.log(pt), mx.float32), mx.array(np.log(ps), mx.float32))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------ offline
@pytest.mark.parametrize(
    "objective",
    [
        {"top_k": 5, "alpha": 0.5, "temperature": 1.0},
        {"top_k": 5, "alpha": 0.7, "temperature": 2.0},
        {"top_k": 0, "alpha": 1.0, "temperature": 1.0},
        {"top_k": 100000, "alpha": 0.3, "temperature": 1.5},
    ],
    ids=["top5", "top5-t2", "full-kd-only", "k-over-vocab"],
)
def test_offline_loss_is_its_formula_in_values_and_gradients(
    tmp_path, llama_dir, teacher_dir, data_dir, objective
):
    from mlx_lm import load

    t = build(recipe(data_dir, llama_dir, teacher_dir, objective), tmp_path)
    shake_adapters(t.model)
    teacher, _ = load(str(teacher_dir))
    obj, cfg = t.objective, t.recipe.objective
    batch = next(obj.batches())[1]
    arrays = t.engine.arrays(batch)
    zs, zt = logits64(t.model, batch), logits64(teacher, batch)
    tau, a, k = cfg.temperature, cfg.alpha, cfg.top_k
    total = kd_sum = 0.0
    picks = []
    for r, j, label in targets_of(batch):
        ls, lt = log_softmax64(zs[r, j] / tau), log_softmax64(zt[r, j] / tau)
        if 0 < k < len(lt):
            top = np.argsort(-lt)[:k]
            pt, ps = np.exp(lt[top]), np.exp(ls[top])
            kl = (pt * (lt[top] - ls[top])).sum() + (1 - pt.sum()) * np.log(
                (1 - pt.sum()) / (1 - ps.sum())
            )
            picks.append((r, j, label, top))
        else:
            kl = (np.exp(lt) * (lt - ls)).sum()
            picks.append((r, j, label, None))
        ce = -log_softmax64(zs[r, j])[label]
        total += a * tau * tau * kl + (1 - a) * ce
        kd_sum += kl
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(picks) == obj.count(batch)
    assert loss.item() == pytest.approx(total, rel=1e-4)
    assert metrics["kd_loss"].item() == pytest.approx(kd_sum, rel=1e-4, abs=1e-6)

    def naive(model):  # the same in MLX, the teacher's side constants
        z = model(mx.array(batch.tokens[:, :-1])).astype(mx.float32)
        out = 0.0
        for r, j, label, top in picks:
            ls = z[r, j] / tau - mx.logsumexp(z[r, j] / tau)
            lt = mx.array(log_softmax64(zt[r, j] / tau), mx.float32)
            if top is None:
                kl = mx.sum(mx.exp(lt) * (lt - ls))
            else:
                idx = mx.array(top)
                pt, ps = mx.exp(lt[idx]), mx.exp(ls[idx])
                rest_t, rest_s = 1 - mx.sum(pt), 1 - mx.sum(ps)
                kl = mx.sum(pt * (lt[idx] - ls[idx])) + rest_t * mx.log(rest_t / rest_s)
            ce = mx.logsumexp(z[r, j]) - z[r, j, label]
            out = out + a * tau * tau * kl + (1 - a) * ce
        return out

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])
    # the plan holds the teacher's weights beside the student's
    plan = estimate(shape_of(t))
    teacher_bytes = sum(v.nbytes for _, v in tree_flatten(teacher.parameters()))
    student_bytes = sum(v.nbytes for _, v in tree_flatten(t.model.parameters()))
    assert plan["weights"] >= teacher_bytes + student_bytes


# ------------------------------------------------------------------------ gkd
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gkd_is_the_generalized_jsd_and_its_ends_the_forward_and_reverse_kl(
    tmp_path, llama_dir, teacher_dir, data_dir, beta
):
    from mlx_lm import load

    objective = {"mode": "gkd", "beta": beta, "lmbda": 0.0, "temperature": 1.5}
    t = build(recipe(data_dir, llama_dir, teacher_dir, objective), tmp_path)
    shake_adapters(t.model)
    teacher, _ = load(str(teacher_dir))
    obj = t.objective
    batch = next(obj.batches())[1]
    assert batch.source == "data"  # lmbda 0, no seq_kd: the data's completions
    arrays = t.engine.arrays(batch)
    zs, zt = logits64(t.model, batch), logits64(teacher, batch)
    total, picks = 0.0, targets_of(batch)
    for r, j, _ in picks:
        ls, lt = log_softmax64(zs[r, j] / 1.5), log_softmax64(zt[r, j] / 1.5)
        ps, pt = np.exp(ls), np.exp(lt)
        if beta == 0.0:  # forward KL(teacher || student)
            total += (pt * (lt - ls)).sum()
        elif beta == 1.0:  # reverse KL(student || teacher)
            total += (ps * (ls - lt)).sum()
        else:
            m = beta * pt + (1 - beta) * ps
            total += beta * (pt * np.log(pt / m)).sum() + (1 - beta) * (ps * np.log(ps / m)).sum()
    loss, count, _ = obj.loss(t.model, arrays)
    assert count.item() == len(picks)
    # float32 log-probs: each position's divergence within about 1e-6 of float64's
    assert loss.item() == pytest.approx(total, rel=1e-4, abs=2e-6 * len(picks))

    def naive(model):
        z = model(mx.array(batch.tokens[:, :-1])).astype(mx.float32)
        out = 0.0
        for r, j, _ in picks:
            ls = z[r, j] / 1.5 - mx.logsumexp(z[r, j] / 1.5)
            pt = mx.array(np.exp(log_softmax64(zt[r, j] / 1.5)), mx.float32)
            ps = mx.exp(ls)
            if beta == 0.0:
                out = out + mx.sum(pt * (mx.log(pt) - ls))
            elif beta == 1.0:
                out = out + mx.sum(ps * (ls - mx.log(pt)))
            else:
                m = beta * pt + (1 - beta) * ps
                out = out + beta * mx.sum(pt * (mx.log(pt) - mx.log(m)))
                out = out + (1 - beta) * mx.sum(ps * (ls - mx.log(m)))
        return out

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


def test_gkd_draws_a_share_of_batches_from_the_student_and_the_rest_from_the_teacher(
    tmp_path, llama_dir, teacher_dir, prompts
):
    objective = {"mode": "gkd", "lmbda": 0.5, "seq_kd": True, "max_completion_length": 6}
    t = build(recipe(prompts, llama_dir, teacher_dir, objective), tmp_path)
    stream = t.objective.batches()
    got = [next(stream)[1] for _ in range(12)]
    sources = {b.source for b in got}
    assert sources == {"student", "teacher"}
    ds = t.train_set.examples
    for b in got:
        for r, i in enumerate(b.index):
            p = ds[i].prompt_ids
            assert list(b.tokens[r, : len(p)]) == p and not b.mask[r, : len(p)].any()
            assert b.mask[r, len(p) : b.lengths[r]].all()  # the drawn completion, trained on
            assert b.lengths[r] - len(p) <= 6 + 1  # and EOS where it ended


# ------------------------------------------------------------------------ on-policy
def test_on_policy_loss_is_the_reverse_kl_on_the_students_own_tokens(
    tmp_path, llama_dir, teacher_dir, prompts
):
    from mlx_lm import load

    objective = {"mode": "on_policy", "max_completion_length": 6}
    t = build(recipe(prompts, llama_dir, teacher_dir, objective), tmp_path)
    shake_adapters(t.model)
    teacher, _ = load(str(teacher_dir))
    obj = t.objective
    batch = next(obj.batches())[1]
    assert batch.source == "student" and batch.n_targets > 0
    arrays = t.engine.arrays(batch)
    zs, zt = logits64(t.model, batch), logits64(teacher, batch)
    picks = targets_of(batch)
    d = {}
    for r, j, label in picks:
        d[r, j] = log_softmax64(zs[r, j])[label] - log_softmax64(zt[r, j])[label]
    loss, count, metrics = obj.loss(t.model, arrays)
    assert count.item() == len(picks)
    assert loss.item() == pytest.approx(sum(d.values()), rel=1e-4, abs=1e-5)
    logp_t = sum(log_softmax64(zt[r, j])[label] for r, j, label in picks)
    assert metrics["teacher_logps"].item() == pytest.approx(logp_t, rel=1e-4)

    def naive(model):  # the policy gradient: sum of (log q - log p) x log q, the first constant
        z = model(mx.array(batch.tokens[:, :-1])).astype(mx.float32)
        out = 0.0
        for r, j, label in picks:
            out = out + float(d[r, j]) * (z[r, j, label] - mx.logsumexp(z[r, j]))
        return out

    same_gradients(t.model, naive, lambda m: obj.loss(m, arrays)[0])


def test_a_teacher_quantized_as_it_loads_is_held_quantized_and_counted_so(
    tmp_path, llama_dir, model_dir_factory, data_dir, capsys
):
    from mlxtune.models import is_quantized

    wide = model_dir_factory("llama", hidden_size=64, intermediate_size=128)
    plans = {}
    for bits in (None, 4):
        r = recipe(data_dir, llama_dir, wide, {"teacher_bits": bits})
        t = build(r, tmp_path, f"bits-{bits}")
        quantized = [n for n, m in t.objective.teacher.named_modules() if is_quantized(m)]
        assert bool(quantized) == (bits is not None)
        plans[bits] = estimate(shape_of(t))["weights"]
        loss, count, _ = t.objective.loss(t.model, t.engine.arrays(next(t.objective.batches())[1]))
        assert np.isfinite(loss.item()) and count.item() > 0
    assert plans[4] < plans[None]  # the 4-bit teacher's weights, not its fp32 ones
    # hidden 32, MLP 96, vocabulary 60: no input a multiple of the group of 64
    narrow = model_dir_factory("llama", intermediate_size=96)
    code, out = run_cli(tmp_path, recipe(data_dir, llama_dir, narrow, {"teacher_bits": 4}), capsys)
    assert code == 2 and "objective.teacher_bits" in out.err


def test_a_gguf_teacher_teaches_as_its_folder_does(tmp_path, llama_dir, teacher_dir, data_dir):
    """The teacher read from a GGUF file (weights, config and tokenizer from the file) gives the
    loss the same teacher gives from its folder."""
    import json as _json

    from mlx_lm import load

    from mlxtune.export.gguf.write import write_gguf_model
    from mlxtune.tokenizer import load_tokenizer

    model, _ = load(str(teacher_dir))
    config = _json.loads((teacher_dir / "config.json").read_text())
    tok = load_tokenizer(teacher_dir)
    (tmp_path / "gguf").mkdir()
    path = write_gguf_model(model, config, tok, teacher_dir, tmp_path / "gguf", "f32", "teacher")
    losses = []
    for teacher in (teacher_dir, path):
        t = build(recipe(data_dir, llama_dir, teacher, {"top_k": 5}), tmp_path, teacher.name)
        batch = next(t.objective.batches())[1]
        losses.append(t.objective.loss(t.model, t.engine.arrays(batch))[0].item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


# ------------------------------------------------------------------------ runs
def test_precomputed_top_k_trains_as_the_live_teacher_and_resumes_exactly(
    tmp_path, llama_dir, teacher_dir, data_dir
):
    live = recipe(data_dir, llama_dir, teacher_dir, {"top_k": 4}, checkpoints={"every": 2})
    pre = recipe(
        data_dir,
        llama_dir,
        teacher_dir,
        {"top_k": 4, "teacher_logits": "precomputed"},
        checkpoints={"every": 2},
    )
    build(live, tmp_path, "live").run()
    t = build(pre, tmp_path, "pre")
    assert t.objective.teacher is None  # no teacher held while training
    t.run()
    a, p = rows(tmp_path / "live"), rows(tmp_path / "pre")
    same_rows(a, p, rel=1e-4, abs=1e-5)
    assert {"kd_loss", "ce_loss"} <= a[0].keys()
    assert any("eval_kd_loss" in x for x in a)
    assert (tmp_path / "pre" / "teacher_topk.safetensors").exists()
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(pre, tmp_path, "crash", callbacks=[make_crash(3)]).run()
    build(pre, tmp_path, "crash", resume="latest").run()
    same_rows(rows(tmp_path / "crash"), p, rel=0, abs=0)


def test_drawn_completions_resume_exactly(tmp_path, llama_dir, teacher_dir, prompts):
    objective = {"mode": "gkd", "lmbda": 0.5, "seq_kd": True, "max_completion_length": 6}
    r = recipe(prompts, llama_dir, teacher_dir, objective, checkpoints={"every": 2})
    build(r, tmp_path, "whole").run()
    whole = rows(tmp_path / "whole")
    assert any("on_policy" in x for x in whole)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(r, tmp_path, "crash", callbacks=[make_crash(3)]).run()
    build(r, tmp_path, "crash", resume="latest").run()
    same_rows(rows(tmp_path / "crash"), whole, rel=0, abs=0)


def run_cli(tmp_path, r, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    code = main(["run", str(path), "--run-dir", str(tmp_path / "out")])
    return code, capsys.readouterr()


def test_a_teacher_of_another_vocabulary_is_refused_by_name(
    tmp_path, llama_dir, data_dir, tokenizer, tokenizer_dir, capsys
):
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer, train_sentencepiece

    bigger = tmp_path / "bigger"
    model, config = build_model(tiny_arch("llama"), len(tokenizer._tokenizer) + 8, seed=1)
    save_model(model, config, bigger, tokenizer, tokenizer_dir)
    code, out = run_cli(tmp_path, recipe(data_dir, llama_dir, bigger, {}), capsys)
    assert code == 2 and "objective.teacher" in out.err and "vocabulary has" in out.err
    assert "Traceback" not in out.err
    # the same size, other tokens
    other_tok = tmp_path / "other-tok"
    texts = [(r["prompt"] + r["completion"])[::-1] for r in reverse_rows(400, seed=1)]
    texts += ["pleh i nac woh ,ih :tnatsissa", "god yzal eht revo spmuj xof"] * 20
    train_sentencepiece(
        texts, other_tok, vocab_size=len(tokenizer._tokenizer), model_type="unigram"
    )
    other = load_tokenizer(other_tok)
    assert len(other._tokenizer) == len(tokenizer._tokenizer)
    twin = tmp_path / "twin"
    model, config = build_model(tiny_arch("llama"), len(tokenizer._tokenizer), seed=1)
    save_model(model, config, twin, other, other_tok)
    code, out = run_cli(tmp_path, recipe(data_dir, llama_dir, twin, {}), capsys)
    assert code == 2 and "is not the student's" in out.err and "Traceback" not in out.err


def test_keys_a_mode_does_not_read_are_noted_and_precomputed_needs_offline(
    tmp_path, llama_dir, teacher_dir, data_dir, capsys
):
    t = build(recipe(data_dir, llama_dir, teacher_dir, {"beta": 0.2, "top_k": 3}), tmp_path)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "objective.beta has no effect: objective.mode is offline" in log
    assert "objective.top_k has no effect" not in log
    del t
    r = recipe(data_dir, llama_dir, teacher_dir, {"mode": "gkd", "teacher_logits": "precomputed"})
    code, out = run_cli(tmp_path, r, capsys)
    assert code == 2 and "objective.teacher_logits" in out.err


@pytest.mark.slow
def test_the_quickstart_student_learns_to_reverse_from_prompts_alone(tmp_path):
    r = shipped_recipe("quickstart-distill.yaml")
    r["objective"]["teacher"] = str(REPO / "recipes" / r["objective"]["teacher"])
    r["samples"] = {"every": None}
    s = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True)).run()
    assert s["exact_match_before"] <= 0.1 and s["exact_match_after"] >= 0.9
