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


def one_and_two(tmp: Path, r: dict, one_strategy="data", strategy="fsdp"):
    """``r`` in this process (strategy ``one_strategy``) and under ``mlxtune run --nproc 2``
    with ``distributed.strategy`` ``strategy``: (the run dirs, the latter's completed
    process)."""
    one, two = tmp / "one", tmp / "two"
    Trainer(
        recipe_from_dict({**r, "distributed": {"strategy": one_strategy}}),
        one,
        console=Console(quiet=True),
    ).run()
    path = tmp / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump({**r, "distributed": {"strategy": strategy}}))
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
    tr = Trainer(  # the other strategy: a change a resumed run honours
        recipe_from_dict({**full["recipe"], "distributed": {"strategy": "data"}}),
        run_dir,
        console=Console(quiet=True),
        resume="step-000004",
    )
    assert tr.position.step == 4
    tr.run()
    same_rows(rows(run_dir), rows(full["two"]), rel=2e-5, abs=1e-6)


def same_exports(one: Path, two: Path, exported: str, rtol: float) -> None:
    """Run ``two``'s export ``exported`` holds the weights of run ``one``'s."""
    file = "model.safetensors" if exported == "fused" else "adapters.safetensors"
    a = mx.load(str(one / "export" / exported / file))
    b = mx.load(str(two / "export" / exported / file))
    assert a.keys() == b.keys()
    for k in a:  # Adam turns a near-zero gradient's round-off into up to lr: atol lr / 30
        np.testing.assert_allclose(np.array(b[k]), np.array(a[k]), rtol=rtol, atol=1e-4)


def test_the_export_equals_the_one_process_runs(full):
    same_exports(full["one"], full["two"], "fused", rtol=1e-4)


def two(tmp: Path, r: dict, run_dir: Path, *more: str, n: int = 2, timeout=300, strategy="fsdp"):
    """``r`` with ``strategy`` under ``mlxtune run --nproc n`` (``more``: its other options)."""
    path = tmp / f"{strategy}-{n}.yaml"
    path.write_text(yaml.safe_dump({**r, "distributed": {"strategy": strategy}}))
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(path), "--run-dir", str(run_dir)]
    cmd += [*more, "--nproc", str(n)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def cut_back(src: Path, dst: Path, keep: str) -> Path:
    """A copy of run ``src`` whose last checkpoint is ``keep`` (the later ones removed)."""
    shutil.copytree(src, dst)
    for c in (dst / "checkpoints").iterdir():
        if c.name != keep:
            shutil.rmtree(c)
    (dst / "summary.json").unlink()
    return dst


def test_a_sharded_run_resumes_exactly_at_the_same_world_size(full, tmp_path):
    run_dir = cut_back(full["two"], tmp_path / "again", "step-000004")
    p = two(tmp_path, full["recipe"], run_dir, "--resume", "step-000004")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert rows(run_dir) == rows(full["two"])  # the same ranks, the same pieces: exact


@pytest.mark.slow  # four processes on two cores: about a minute
def test_a_two_rank_checkpoint_resumes_on_four_ranks(full, tmp_path):
    run_dir = cut_back(full["two"], tmp_path / "four", "step-000004")
    p = two(tmp_path, full["recipe"], run_dir, "--resume", "step-000004", n=4, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "1/4 of the 2 blocks" in p.stdout + p.stderr
    same_rows(rows(run_dir), rows(full["two"]), rel=2e-5, abs=1e-6)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer, tokenizer_dir):
    from mlx_lm_archs import tiny_config

    from mlxtune.models import family_classes, save_model

    mx.random.seed(2)
    # experts 64 wide: each of two ranks' 32 columns are whole groups of a 4-bit base
    config = {**tiny_config("qwen3_moe", 64), "moe_intermediate_size": 64}
    model_class, args_class = family_classes(config)
    folder, _ = save_model(
        model_class(args_class.from_dict(config)),
        config,
        tmp_path_factory.mktemp("moe"),
        tokenizer,
        tokenizer_dir,
    )
    return folder


LORA = {"type": "lora", "rank": 4, "alpha": 8, "targets": ["all-linear"]}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param("lora", id="llama-lora"),
        # suite time: a QLoRA base and a mixture's full fine-tuning run with -m slow
        pytest.param("qlora", id="llama-qlora", marks=pytest.mark.slow),
        pytest.param("moe-full", id="qwen3_moe-full", marks=pytest.mark.slow),
        pytest.param("moe-qlora", id="qwen3_moe-qlora"),
    ],
)
def test_adapters_and_an_moe_family_shard_as_one_process(case, tmp_path, llama_dir, moe_dir):
    model_dir = moe_dir if case.startswith("moe") else llama_dir
    adapter = {"type": "full"} if case.endswith("full") else LORA
    exported = "fused" if adapter["type"] == "full" else "mlx-lm"
    r = recipe(data(tmp_path), model_dir, adapter, export={"formats": [exported]})
    r["samples"] = {"every": None}
    r["eval"] = {"every": 3}
    if case.endswith("qlora"):  # the frozen quantized base is sharded too
        r["model"] = {"path": str(model_dir), "quantize": {"bits": 4, "group_size": 32}}
    one, two_dir, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    same_rows(rows(one), rows(two_dir), rel=2e-5, abs=1e-6)
    same_exports(one, two_dir, exported, rtol=1e-4)


def test_what_fsdp_cannot_train_is_refused_by_name(tmp_path, llama_dir):
    from mlxtune.errors import UserInputError

    r = recipe(data(tmp_path), llama_dir, {"type": "full"})
    for name in ("muon", "adafactor", "sophia", "adamw8bit"):
        bad = {**r, "optimizer": {"name": name}, "distributed": {"strategy": "fsdp"}}
        with pytest.raises(UserInputError) as e:
            recipe_from_dict(bad)
        assert e.value.where.endswith("optimizer.name") and "fsdp" in str(e.value)
    with pytest.raises(UserInputError) as e:
        recipe_from_dict({**r, "distributed": {"strategy": "tensors"}})
    assert "distributed.strategy" in str(e.value.where)


def test_objectives_that_generate_and_vision_models_are_refused_by_name(llama_dir):
    from mlxtune.distributed import World
    from mlxtune.errors import UserInputError
    from mlxtune.loop.setup import shard_model
    from mlxtune.models import load_model

    class Rollouts:  # what the set-up reads of an objective that generates while it trains
        name = "grpo"

        def generates(self):
            return True

    model, _ = load_model(llama_dir)
    with pytest.raises(UserInputError) as e:
        shard_model(model, Rollouts(), World(0, 2), print)
    assert e.value.where == "distributed.strategy" and "grpo generates" in str(e.value)
    logged = []
    shard_model(model, Rollouts(), World(0, 1), logged.append)  # one process: nothing to do
    assert "no effect in one process" in logged[0]


@pytest.mark.parametrize(
    "case",
    [
        # suite time: full fine-tuning and QLoRA of a llama, LoRA of a mixture with -m slow
        pytest.param("full", id="llama-full", marks=pytest.mark.slow),
        pytest.param("lora", id="llama-lora"),
        pytest.param("qlora", id="llama-qlora", marks=pytest.mark.slow),
        pytest.param("moe-full", id="qwen3_moe-full"),
        pytest.param("moe-lora", id="qwen3_moe-lora", marks=pytest.mark.slow),
        pytest.param("moe-qlora", id="qwen3_moe-qlora", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_trains_as_one_process(case, tmp_path, model_dir_factory, moe_dir):
    """Heads and MLP columns split between two ranks, each on the whole batch: the loss rows
    of one process, a whole checkpoint that resumes on one, and the same export."""
    model_dir = model_dir_factory(
        "llama", hidden_size=64, intermediate_size=128, num_key_value_heads=2
    )
    if case.startswith("moe-"):  # each expert's columns split; the router whole
        model_dir, case = moe_dir, case.removeprefix("moe-")
    adapter = {"type": "full"} if case == "full" else LORA
    exported = "fused" if case == "full" else "mlx-lm"
    r = recipe(data(tmp_path), model_dir, adapter, export={"formats": [exported]})
    if case == "qlora":
        r["model"] = {"path": str(model_dir), "quantize": {"bits": 4, "group_size": 32}}
    one, two_dir, p = one_and_two(tmp_path, r, strategy="tensor")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "tensor-parallel: each of 2 ranks holds 1/2" in out
    # the head by vocabulary too (a quantized one stays whole, and the log says why)
    assert ("the whole head (a " if case == "qlora" else "1/2 of the head's vocabulary") in out
    # a quantized base runs MLX's quantized product where one process de-quantizes: looser
    tol = 2e-4 if case == "qlora" else 2e-5
    same_rows(rows(one), rows(two_dir), rel=tol, abs=1e-6)
    same_exports(one, two_dir, exported, rtol=1e-3)
    if case == "lora":  # the checkpoint is whole: resumed at 2 ranks exactly, and on one
        run_dir = cut_back(two_dir, tmp_path / "again", "step-000004")
        p = two(tmp_path, r, run_dir, "--resume", "step-000004", strategy="tensor")
        assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
        assert rows(run_dir) == rows(two_dir)
        run_dir = cut_back(two_dir, tmp_path / "alone", "step-000004")
        tr = Trainer(
            recipe_from_dict({**r, "distributed": {"strategy": "data"}}),
            run_dir,
            console=Console(quiet=True),
            resume="step-000004",
        )
        tr.run()
        same_rows(rows(run_dir), rows(two_dir), rel=2e-5, abs=1e-6)


def test_tensor_parallelism_refuses_what_it_cannot_split(llama_dir):
    from mlx_lm_archs import tiny_config

    from mlxtune.distributed import World
    from mlxtune.errors import UserInputError
    from mlxtune.loop.setup import split_model
    from mlxtune.models import build_model, load_model
    from mlxtune.tensor import refusal

    llama, _ = load_model(llama_dir)  # 4 heads, 4 key/value heads
    assert refusal(llama, 2) is None
    assert "do not divide by 3 ranks" in refusal(llama, 3)
    mla, _ = build_model(tiny_config("deepseek_v3", 61), 61)  # multi-head latent attention
    with pytest.raises(UserInputError) as e:
        split_model(mla, None, World(0, 2), print)
    assert e.value.where == "distributed.strategy" and "deepseek_v3" in str(e.value)


@pytest.mark.slow  # four processes on two cores: about a minute
def test_four_tensor_parallel_ranks_train_as_one_process(tmp_path, model_dir_factory):
    model_dir = model_dir_factory(
        "llama", hidden_size=64, intermediate_size=128, num_key_value_heads=4
    )
    r = recipe(data(tmp_path), model_dir, LORA, export={"formats": ["mlx-lm"]})
    one = tmp_path / "one"
    Trainer(recipe_from_dict(r), one, console=Console(quiet=True)).run()
    p = two(tmp_path, r, tmp_path / "four", n=4, timeout=600, strategy="tensor")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "each of 4 ranks holds 1/4" in p.stdout + p.stderr
    same_rows(rows(one), rows(tmp_path / "four"), rel=2e-5, abs=1e-6)


@pytest.mark.slow  # suite time: data parallelism's test covers the same watchdog in the default run
@pytest.mark.parametrize("strategy", ["fsdp", "tensor"])
def test_a_dead_rank_ends_a_divided_run_with_a_message(full, tmp_path, strategy):
    """As in data parallelism: rank 1 dies after step 5 without a word; rank 0, inside the next
    step's collectives, ends with the message, and checkpoint step-000004 is intact."""
    from test_distributed import launch

    from mlxtune.runs.checkpoint import verify

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**full["recipe"], "distributed": {"strategy": strategy}}))
    run_dir = tmp_path / "dead"
    codes, out, took = launch(tmp_path, path, run_dir, "--die-at", "5", "--rank", "1")
    assert codes[1] is None  # it died without a word
    assert codes[0] == 1, out[-3000:]
    assert "rank 0 lost contact with rank 1" in out
    assert took < 120
    assert verify(run_dir / "checkpoints" / "step-000004") is None
    assert not (run_dir / "checkpoints" / "step-000006").exists()


def test_a_dry_run_shows_a_ranks_plan_and_data_parallelisms(full, tmp_path):
    p = two(tmp_path, full["recipe"], tmp_path / "dry", "--dry-run")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "that is a rank's, the blocks divided among 2 ranks (fsdp)" in out
    assert "with distributed.strategy: data" in out
    assert "parallel 2 ranks (ring, fsdp)" in out


@pytest.mark.slow  # suite time: about 10 s a strategy
@pytest.mark.parametrize("strategy", ["fsdp", "tensor"])
def test_mixed_precision_and_accumulation_divide_as_one_process(tmp_path, llama_dir, strategy):
    """bf16 weights with fp32 masters and dynamic loss scaling, two micro-batches a step: the
    rows of one process within bf16's round-off, the masters written whole."""
    r = recipe(data(tmp_path), llama_dir, {"type": "full"}, export={"formats": []})
    r["model"] = {"path": str(llama_dir), "dtype": "bfloat16"}
    r["train"] = {**r["train"], "grad_accumulation": 2, "batch_size": 4}
    r["samples"], r["eval"] = {"every": None}, {"every": 3}
    one, two_dir, p = one_and_two(tmp_path, r, strategy=strategy)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    same_rows(rows(one), rows(two_dir), rel=2e-2, abs=1e-3)
    a = mx.load(str(one / "checkpoints" / "step-000004" / "masters.safetensors"))
    b = mx.load(str(two_dir / "checkpoints" / "step-000004" / "masters.safetensors"))
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
