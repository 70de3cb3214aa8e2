"""Long context on the CPU: a 16k-token row trains on the tiny model through the chunked
attention tier, by slabs of queries against the keys they see (a graph that grows with T, not
T^2), far below the memory one layer's [T, T] scores would take."""

import json
import math

import numpy as np
import pytest

from conftest import tiny_recipe, write_jsonl
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console


@pytest.mark.slow  # about a minute on 2 cores: suite time
def test_a_16k_token_row_trains_on_the_tiny_model(tmp_path, llama_dir, tokenizer):
    t = 16384
    rng = np.random.default_rng(0)
    vocab = len(tokenizer._tokenizer)
    rows = [{"input_ids": rng.integers(3, vocab, t).tolist()} for _ in range(2)]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    write_jsonl(tmp_path / "data" / "valid.jsonl", rows[:1])
    r = tiny_recipe(
        tmp_path / "data",
        llama_dir,
        data={
            "train": str(tmp_path / "data" / "train.jsonl"),
            "valid": str(tmp_path / "data" / "valid.jsonl"),
            "max_length": t,
        },
        train={"batch_size": 1, "max_steps": 2, "log_every": 1, "progress": False},
        eval={"every": None, "max_batches": 1},
        memory={"check": "off"},
    )
    r["kernels"] = {"attention": "chunked", "loss": "chunked"}
    summary = Trainer(
        recipe_from_dict(r), run_dir=tmp_path / "run", console=Console(quiet=True)
    ).run()
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(vocab)) < 1.0  # random tokens: about log V, as it should
    heads = 4
    scores_gb = heads * t * t * 4 / 1e9  # one layer's fp32 scores: 4.3 GB
    assert summary["peak_memory_gb"] < scores_gb / 8
