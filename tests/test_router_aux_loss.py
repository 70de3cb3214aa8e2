"""The routers' load-balancing loss of mixture-of-experts models: the formula (against a NumPy
float64 one written here, and transformers' own function), the routers found in any family, and
``objective.router_aux_loss_coef`` in a run."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm_archs import tiny_config
from test_families import VOCAB, run
from test_interop import interop

from mlxtune.errors import UserInputError
from mlxtune.models import build_model, family_classes, save_model
from mlxtune.models.moe import (
    experts_per_token,
    load_balancing_loss,
    router_logits,
    router_paths,
)


def naive(logits: list[np.ndarray], k: int, valid: np.ndarray) -> float:
    """E x sum_e (tokens sent to e per token) x (mean router probability of e), float64, over
    the valid tokens of every layer together."""
    rows = np.concatenate([z.reshape(-1, z.shape[-1]) for z in logits]).astype(np.float64)
    w = np.tile(valid.reshape(-1), len(logits)).astype(bool)
    rows = rows[w]
    e = rows.shape[1]
    p = np.exp(rows - rows.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    sent = np.zeros(e)
    for row in p:
        for j in np.argsort(-row)[:k]:
            sent[j] += 1
    return float(e * np.sum(sent / len(rows) * p.mean(axis=0)))


def test_the_loss_is_the_formula_and_transformers_function():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(2, 5, 6)).astype(np.float32) for _ in range(3)]
    valid = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    got = load_balancing_loss([mx.array(z) for z in logits], 2, mx.array(valid)).item()
    assert got == pytest.approx(naive(logits, 2, valid), rel=1e-5)
    # uniform routing gives k, concentrated routing more
    flat = [mx.zeros((4, 6))]
    assert load_balancing_loss(flat, 2).item() == pytest.approx(2.0, rel=1e-6)
    peaked = [mx.array(np.tile([5.0, 4.0, 0, 0, 0, 0], (4, 1)))]
    assert load_balancing_loss(peaked, 2).item() > 2.5
    torch = interop("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    every = np.ones_like(valid)
    want = load_balancing_loss_func(
        tuple(torch.tensor(z.reshape(-1, 6)) for z in logits), 6, 2, torch.tensor(every)
    ).item()
    assert load_balancing_loss([mx.array(z) for z in logits], 2).item() == pytest.approx(
        want, rel=1e-5
    )


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "olmoe", "granitemoe"])
def test_routers_are_found_and_seen_in_any_family(name):
    model, _ = build_model(tiny_config(name, VOCAB), VOCAB)
    paths = router_paths(model)
    assert paths and experts_per_token(model) == 2
    x = mx.array([[1, 5, 9, 12, 7]])
    with router_logits(model, paths) as seen:
        model(x)
    assert len(seen) == len(paths)
    assert all(z.shape[-1] == 4 and z.size // 4 == 5 for z in seen)
    dense, _ = build_model(tiny_config("llama", VOCAB), VOCAB)
    assert router_paths(dense) == []


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_adds_the_weighted_loss_and_logs_it(tmp_path, data_dir, tokenizer, tokenizer_dir):
    mx.random.seed(2)
    config = tiny_config("qwen3_moe", VOCAB)
    model_class, args_class = family_classes(config)
    save_model(
        model_class(args_class.from_dict(config)), config, tmp_path / "m", tokenizer, tokenizer_dir
    )
    lora = {"type": "lora", "rank": 4, "alpha": 16, "targets": ["all-linear"]}
    run(tmp_path / "plain", data_dir, tmp_path / "m", adapter=lora)
    run(
        tmp_path / "aux",
        data_dir,
        tmp_path / "m",
        adapter=lora,
        objective={"type": "sft", "router_aux_loss_coef": 0.5},
        eval={"every": 5},
    )
    plain, aux = rows(tmp_path / "plain" / "run"), rows(tmp_path / "aux" / "run")
    first = aux[0]
    assert first["router_aux_loss"] > 1.0  # 2 experts a token: at least near k = 2
    # the first step's weights are the same: the losses differ by the weighted aux loss
    assert first["loss"] == pytest.approx(
        plain[0]["loss"] + 0.5 * first["router_aux_loss"], rel=1e-4
    )
    evals = [r for r in aux if "eval_loss" in r]
    assert evals and all("eval_router_aux_loss" in r for r in evals)


def test_a_model_without_routers_is_refused(tmp_path, data_dir, llama_dir):
    with pytest.raises(UserInputError, match="needs a mixture-of-experts model"):
        run(tmp_path, data_dir, llama_dir, objective={"type": "sft", "router_aux_loss_coef": 0.1})
