"""``distributed.strategy: fsdp`` through ``mlxtune run --nproc 2`` on MLX's ring backend: two
processes, each holding half of every block, train as one process does (loss rows equal
within fp32 round-off), write checkpoints whole that resume on one process, and export what
the one-process run exports."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import yaml

from conftest import TIMING, reverse_rows, same_rows, tiny_recipe, write_jsonl
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console

LAUNCH = Path(sys.executable).with_name("mlx.launch")

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def rows(run_dir):
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        out.append({k: v for k, v in json.loads(line).items() if k not in TIMING})
    return out


def recipe(data, model_dir, adapter, **more):
    r = tiny_recipe(
        data,
        model_dir,
        adapter=adapter,
        optimizer={"lr": 3e-3, "grad_clip": 0.5, "weight_decay": 0.1},
        train={
            "batch_size": 8,
            "max_steps": 6,
            "log_every": 1,
            "progress": False,
            "seed": 3,
            "grad_checkpointing": True,
        },
        eval={"every": 3, "exact_match": 3, "max_new_tokens": 6},
        samples={"every": 3, "count": 2, "max_new_tokens": 6},
        checkpoints={"every": 2, "keep_last": 10},
        export={"formats": ["fused"]},
    )
    r.update(more)
    return r


def one_and_two(tmp: Path, r: dict, one_strategy="data"):
    """``r`` in this process (strategy ``one_strategy``) and under ``mlxtune run --nproc 2``
    with ``distributed.strategy: fsdp``: (the run dirs, the latter's completed process)."""
    one, two = tmp / "one", tmp / "two"
    Trainer(
        recipe_from_dict({**r, "distributed": {"strategy": one_strategy}}),
        one,
        console=Console(quiet=True),
    ).run()
    path = tmp / "fsdp.yaml"
    path.write_text(yaml.safe_dump({**r, "distributed": {"strategy": "fsdp"}}))
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(path), "--run-dir", str(two)]
    p = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True, timeout=300)
    return one, two, p


def data(tmp: Path) -> Path:
    d = tmp / "data"
    write_jsonl(d / "train.jsonl", reverse_rows(96, seed=2))
    write_jsonl(d / "valid.jsonl", reverse_rows(20, seed=3))  # 3 eval batches: 2 and 1 a rank
    return d


@pytest.fixture(scope="module")
def full(tmp_path_factory, llama_dir):
    """Full fine-tuning, one process and two fully sharded ones."""
    tmp = tmp_path_factory.mktemp("fsdp")
    r = recipe(data(tmp), llama_dir, {"type": "full"})
    one, two, p = one_and_two(tmp, r)
    return {"one": one, "two": two, "proc": p, "recipe": r}


def test_full_fine_tuning_sharded_trains_as_one_process(full):
    p = full["proc"]
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "fully sharded: each of 2 ranks holds 1/2" in out
    assert "no reduce-scatter" in out  # ring: said once
    one, two = rows(full["one"]), rows(full["two"])
    same_rows(one, two, rel=2e-5, abs=1e-6)
    assert [x.get("world_size") for x in two if "loss" in x] == [2] * 6
    # samples and exact match were drawn with every rank in step: rank 0's tokens, recorded once
    samples = (full["two"] / "samples.jsonl").read_text().splitlines()
    assert len(samples) == len((full["one"] / "samples.jsonl").read_text().splitlines())


def test_a_sharded_checkpoint_is_whole_and_resumes_on_one_process(full, tmp_path):
    a = mx.load(str(full["one"] / "checkpoints" / "step-000004" / "adapters.safetensors"))
    b = mx.load(str(full["two"] / "checkpoints" / "step-000004" / "adapters.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-4, atol=1e-5)
    for name in ("optimizer.safetensors",):
        a = mx.load(str(full["one"] / "checkpoints" / "step-000004" / name))
        b = mx.load(str(full["two"] / "checkpoints" / "step-000004" / name))
        assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    # the two-rank checkpoint, resumed by one process with strategy data: the same run
    run_dir = tmp_path / "alone"
    shutil.copytree(full["two"], run_dir)
    for name in ("final", "best", "step-000006"):
        shutil.rmtree(run_dir / "checkpoints" / name, ignore_errors=True)
    (run_dir / "summary.json").unlink()
    tr = Trainer(
        recipe_from_dict({**full["recipe"], "distributed": {"strategy": "fsdp"}}),
        run_dir,
        console=Console(quiet=True),
        resume="step-000004",
    )
    assert tr.position.step == 4
    tr.run()
    same_rows(rows(run_dir), rows(full["two"]), rel=2e-5, abs=1e-6)


def test_the_export_equals_the_one_process_runs(full):
    a = mx.load(str(full["one"] / "export" / "fused" / "model.safetensors"))
    b = mx.load(str(full["two"] / "export" / "fused" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=1e-4, atol=1e-5)
