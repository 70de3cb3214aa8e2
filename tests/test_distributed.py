"""Data-parallel training on MLX's ring backend: two processes on this machine's CPU
(``mlx.launch -n 2``) train exactly as one process with the same global batch, stop and resume
together, resume on one process, and end within seconds when a rank dies."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TIMING, same_rows, tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.console import Console
from mlxtune.distributed import blas_threads, free_ports
from mlxtune.runs.checkpoint import verify

LAUNCH = Path(sys.executable).with_name("mlx.launch")
WORKER = Path(__file__).with_name("dp_worker.py")

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def recipe(data_dir, llama_dir, steps=8):
    return tiny_recipe(
        data_dir,
        llama_dir,
        train={"batch_size": 8, "max_steps": steps, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 3},
        checkpoints={"every": 2, "keep_last": 10},
        # named tiers: runs compared bit for bit must not time their way to different ones
        kernels={"loss": "chunked", "attention": "native"},
    )


def write(tmp_path, r) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(yaml.safe_dump(r))
    return p


def rows(run_dir):
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        out.append({k: v for k, v in json.loads(line).items() if k not in TIMING})
    return out


def launch(tmp_path, *args, n=2, timeout=240):
    """The worker in ``n`` processes under mlx.launch: (exit codes by rank, output, seconds)."""
    codes = tmp_path / f"codes-{time.monotonic_ns()}"
    codes.mkdir()
    cmd = [str(LAUNCH), "-n", str(n), "--starting-port", str(free_ports(n)), "--"]
    cmd += [sys.executable, str(WORKER), *map(str, args[:2]), str(codes), *map(str, args[2:])]
    t = time.perf_counter()
    # each rank's BLAS threads as `mlxtune run --nproc` gives them: the same matmul sums
    env = {**os.environ, **blas_threads(n)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    took = time.perf_counter() - t
    got = {}
    for rank in range(n):
        f = codes / f"rank-{rank}"
        got[rank] = int(f.read_text()) if f.exists() else None
    return got, p.stdout + p.stderr, took


def same(a, b, rel=1e-5, abs=1e-7):
    """Metrics rows equal: counts exactly, losses and norms within fp32 round-off."""
    same_rows(a, b, rel, abs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, llama_dir):
    """One process, and two under ``mlxtune run --nproc 2``, on the same recipe."""
    tmp = tmp_path_factory.mktemp("dp")
    data = tmp / "data"
    from conftest import reverse_rows, write_jsonl

    write_jsonl(data / "train.jsonl", reverse_rows(96, seed=2))
    write_jsonl(data / "valid.jsonl", reverse_rows(20, seed=3))  # 3 eval batches: 2 and 1 a rank
    r = recipe(data, llama_dir)
    one, two, p = one_and_two(tmp, r)
    return {"one": one, "two": two, "proc": p, "recipe": r, "path": tmp / "recipe.yaml"}


def one_and_two(tmp, r):
    """``r`` in this process, and under ``mlxtune run --nproc 2``: (run dirs, the latter's
    completed process)."""
    one, two = tmp / "one", tmp / "two"
    Trainer(recipe_from_dict(r), one, console=Console(quiet=True)).run()
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(write(tmp, r)), "--run-dir", str(two)]
    p = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True, timeout=240)
    return one, two, p


def test_two_processes_train_as_one(runs):
    p = runs["proc"]
    assert p.returncode == 0, p.stdout + p.stderr
    one, two = rows(runs["one"]), rows(runs["two"])
    assert [x.get("world_size") for x in two if "loss" in x] == [2] * 8
    same(one, two)
    steps = [x for x in two if "loss" in x]
    assert [x["step"] for x in steps] == list(range(1, 9))
    # rank 0 alone wrote the run: one header, every checkpoint once
    assert (p.stdout + p.stderr).count("run      ") == 1
    names = sorted(x.name for x in (runs["two"] / "checkpoints").iterdir())
    assert names == ["best", "final", "step-000002", "step-000004", "step-000006", "step-000008"]
    cfg = json.loads((runs["two"] / "config_resolved.json").read_text())
    assert cfg["derived"]["world_size"] == 2 and cfg["derived"]["batch_per_rank"] == 4


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_interrupted_and_resumed_together_equals_the_whole_run(runs, tmp_path):
    run_dir = tmp_path / "cut"
    (run_dir / "control").mkdir(parents=True)
    (run_dir / "control" / "save").write_text("")  # rank 0 reads it: every rank agrees
    codes, out, _ = launch(tmp_path, runs["path"], run_dir, "--sigint-at", "3", "--rank", "1")
    assert codes == {0: 130, 1: 130}, out
    assert "interrupted (SIGINT) after step 3" in out
    assert (run_dir / "checkpoints" / "step-000001").is_dir()  # the save request
    assert (run_dir / "checkpoints" / "step-000003").is_dir()
    codes, out, _ = launch(tmp_path, runs["path"], run_dir, "--resume")
    assert codes == {0: 0, 1: 0}, out
    assert rows(run_dir) == rows(runs["two"])  # the same ranks, the same sums: exact


def test_a_two_process_checkpoint_resumes_on_one(runs, tmp_path):
    import shutil

    run_dir = tmp_path / "alone"
    shutil.copytree(runs["two"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "final")
    for name in ("best", "step-000006", "step-000008"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    (run_dir / "summary.json").unlink()
    tr = Trainer(
        recipe_from_dict(runs["recipe"]), run_dir, console=Console(quiet=True), resume="latest"
    )
    assert tr.position.step == 4
    tr.run()
    same(rows(run_dir), rows(runs["two"]))


def test_a_dead_rank_ends_the_others_with_a_message(runs, tmp_path):
    run_dir = tmp_path / "dead"
    codes, out, took = launch(tmp_path, runs["path"], run_dir, "--die-at", "5", "--rank", "1")
    assert codes[1] is None  # it died without a word
    assert codes[0] == 1, out
    assert "rank 0 lost contact with rank 1" in out
    assert took < 120
    ckpt = run_dir / "checkpoints" / "step-000004"
    assert verify(ckpt) is None
    assert not (run_dir / "checkpoints" / "step-000006").exists()


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of a child of ``launcher`` started as ``rank`` (MLX_RANK in its environment)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == launcher and f"MLX_RANK={rank}".encode() in env:
            return int(proc.name)
    return None


@pytest.mark.slow  # 23 s: the default run stays under 10 minutes (a dead rank's test stays)
@pytest.mark.skipif(not Path("/proc").exists(), reason="finds the rank's process in /proc")
def test_a_frozen_rank_ends_the_others_naming_it(runs, tmp_path):
    """A rank stopped (SIGSTOP: a machine that froze or slept, its sockets open) fails no
    collective; the others see it no longer alive and end, naming it, the step and the resume
    command, with the last checkpoint intact."""
    import os
    import signal

    r = dict(runs["recipe"])
    r["train"] = {**r["train"], "max_steps": 400}
    r["distributed"] = {"timeout_s": 3600}  # not the wait's limit: rank 1 is seen frozen
    path = write(tmp_path, r)
    run_dir = tmp_path / "frozen"
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(path), "--run-dir", str(run_dir)]
    p = subprocess.Popen(
        [*cmd, "--nproc", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "step-000004").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.stdout.read()
            time.sleep(0.2)
        pid = _rank_pid(p.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = p.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, out
    assert "rank 0: no answer from rank 1 for" in out, out
    assert "it froze, slept or lost its link" in out
    assert f"continue with: mlxtune run {path} --run-dir {run_dir} --resume" in out
    assert took < 60, took  # seen frozen after 15 s, not after the hour
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert saved and verify(saved[-1]) is None
    assert "no answer from rank 1" in (run_dir / "log.txt").read_text()


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_slow_rank_that_is_alive_is_waited_for(runs, tmp_path):
    """Rank 1 sleeps 8 s after step 3 (alive: its watchdog marks it so); with a 3 s limit rank
    0 waits for it all the same (up to 4 x the limit for a rank seen alive)."""
    r = dict(runs["recipe"])
    r["distributed"] = {"timeout_s": 3}
    r["train"] = {**r["train"], "max_steps": 5}
    path = write(tmp_path, r)
    codes, out, took = launch(
        tmp_path, path, tmp_path / "slow", "--sleep-at", "3", "--sleep-s", "8"
    )
    assert codes == {0: 0, 1: 0}, out
    assert "no answer" not in out and took > 8


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_rank_out_of_memory_splits_every_rank(runs, tmp_path):
    run_dir = tmp_path / "oom"
    codes, out, _ = launch(tmp_path, runs["path"], run_dir, "--oom-at", "3", "--rank", "1")
    assert codes == {0: 0, 1: 0}, out
    assert "step 3: out of memory (on another rank); going on with micro-batches of 2" in out
    state = json.loads((run_dir / "checkpoints" / "final" / "trainer_state.json").read_text())
    assert state["resume"]["micro_split"] == 2  # rank 0 split too
    same(rows(run_dir), rows(runs["two"]))  # the same examples per step


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_dry_run_shows_the_ranks(runs):
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(runs["path"]), "--dry-run"]
    p = subprocess.run([*cmd, "--nproc", "2"], capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "parallel 2 ranks (ring, data), about 4 of the 8 examples of a batch each" in out
    assert out.count("dry run: one step compiled") == 1


@pytest.mark.slow
def test_every_rank_refuses_a_bad_resume_and_validate_names_its_rank(runs, tmp_path):
    cmd = [sys.executable, "-m", "mlxtune.cli", "run", str(runs["path"]), "--dry-run"]
    # every rank refuses a resume with no run: --nproc exits as they do
    bad = [*cmd[:-1], "--resume", "--run-dir", str(tmp_path / "none"), "--nproc", "2"]
    p = subprocess.run(bad, capture_output=True, text=True, timeout=240)
    assert p.returncode == 2 and "no run to resume here" in p.stderr, p.stdout + p.stderr
    cmd = [str(LAUNCH), "-n", "2", "--starting-port", str(free_ports(2)), "--"]
    cmd += [sys.executable, "-m", "mlxtune.cli", "validate", str(runs["path"])]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert "data-parallel: rank 0 of 2 (ring); global batch 8, about 4 examples a rank" in p.stdout


def test_each_rank_draws_its_own_dropout_masks_from_the_shared_state():
    """Ranks advance the shared random state alike (a checkpoint's state serves any number of
    ranks) but draw adapter dropout from keys of their own."""
    import mlx.core as mx

    from mlxtune.distributed import World
    from mlxtune.engine.steps import Engine
    from mlxtune.models import current

    def draw(rank, size=2):
        eng = Engine.__new__(Engine)
        eng.world, eng._has_dropout, eng.layout = World(rank=rank, size=size), True, None
        mx.random.seed(7)
        with eng._rank_dropout():
            mask = mx.random.bernoulli(0.5, (64,), key=current().dropout_keys.next())
        return mask.tolist(), mx.random.state[0].tolist()

    (m0, s0), (m1, s1) = draw(0), draw(1)
    assert s0 == s1  # the shared state moved alike
    assert m0 != m1  # the masks did not
    assert draw(0) == (m0, s0)  # and it is all determined by the state


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_packed_rows_and_accumulation_stay_exact(runs, tmp_path):
    """Packed rows (segments split with their rows) and two micro-batches a step."""
    r = dict(runs["recipe"])
    r["data"] = {**r["data"], "packing": "pack", "pack_length": 48}
    r["train"] = {**r["train"], "batch_size": 4, "grad_accumulation": 2, "max_steps": 4}
    r["eval"] = {"every": 2}
    r["checkpoints"] = {"every": None, "save_final": False, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    got = rows(two)
    assert any("packing_utilization" in x for x in got)
    same(rows(one), got)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_streamed_training_set_trains_as_one(runs, tmp_path):
    """data.streaming: every rank reads the same windows and takes its share of each batch."""
    r = dict(runs["recipe"])
    r["data"] = {**r["data"], "streaming": True, "stream_window": 40}
    r["train"] = {**r["train"], "max_steps": 6}
    r["checkpoints"] = {"every": 3, "save_final": False, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    same(rows(one), rows(two))
    state = json.loads((two / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["resume"]["data_stream"]["epoch"] == 0


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_non_finite_step_on_one_rank_is_skipped_by_all(runs, tmp_path):
    r = dict(runs["recipe"], precision={"nonfinite": "skip", "max_skipped": 2})
    path = tmp_path / "skip.yaml"
    path.write_text(yaml.safe_dump(r))
    run_dir = tmp_path / "nan"
    codes, out, _ = launch(tmp_path, path, run_dir, "--nan-at", "4", "--rank", "1")
    assert codes == {0: 0, 1: 0}, out
    assert out.count("WARNING: step 4: the loss became nan; update skipped") == 1  # rank 0's
    got = rows(run_dir)
    steps = {x["step"]: x for x in got if "loss" in x}
    assert steps[4]["skipped_steps"] == 1 and steps[5]["skipped_steps"] == 1


def test_the_dashboard_is_refused_in_front_of_ranks(runs, capsys):
    from mlxtune.cli import main

    assert main(["run", str(runs["path"]), "--tui", "--nproc", "2"]) == 2
    assert (
        "--tui: the dashboard cannot run in front of a data-parallel run" in capsys.readouterr().err
    )


def test_a_failed_collective_names_the_lost_rank_and_other_errors_pass():
    from mlxtune.distributed import PeerLost, World, collectives

    with pytest.raises(PeerLost, match="rank 1 lost contact with rank 0 .*--resume"):
        with collectives(World(rank=1, size=2)):
            raise RuntimeError("[ring] connection to a peer was lost")
    with pytest.raises(RuntimeError, match="string during"):  # no word of a lost peer
        with collectives(World(rank=1, size=2)):
            raise RuntimeError("bad string during descending")


def test_every_rank_runs_as_many_micro_batches(tmp_path, data_dir, llama_dir):
    """An odd batch leaves ranks uneven shares; split for memory, the smaller share is padded
    with micro-batches that count nothing, so both ranks step (and draw dropout) alike."""
    from mlxtune.data import make_batch
    from mlxtune.distributed import World

    tr = Trainer(
        recipe_from_dict(tiny_recipe(data_dir, llama_dir)),
        tmp_path / "r",
        console=Console(quiet=True),
    )
    eng = tr.engine
    b = make_batch(tr.train_set.examples[:3], tr.pad_id, 8)
    eng.split = 2
    got = {}
    for rank in (0, 1):
        eng.world = World(rank=rank, size=2)
        got[rank] = eng.micro_batches([b])
    assert [len(p.tokens) for p in got[0]] == [1, 1]  # 2 rows, split in 2
    assert [len(p.tokens) for p in got[1]] == [1, 1]  # 1 row, and one that counts nothing
    assert [p.n_targets for p in got[1]][1] == 0 and not got[1][1].mask.any()
    assert sum(p.n_targets for ps in got.values() for p in ps) == b.n_targets


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_preference_pairs_train_as_one(runs, tmp_path):
    """DPO with its adapters-off reference: pairs split whole among the ranks, and
    precomputed reference log-probs computed on every rank alike."""
    from test_preference import pair_rows

    from conftest import write_jsonl

    data = tmp_path / "prefs"
    write_jsonl(data / "train.jsonl", pair_rows(40, 1))
    write_jsonl(data / "valid.jsonl", pair_rows(9, 2))
    for reference in ("auto", "precomputed"):
        r = dict(runs["recipe"])
        r["data"] = {"train": str(data / "train.jsonl"), "valid": str(data / "valid.jsonl")}
        r["objective"] = {"type": "dpo", "beta": 0.5, "reference": reference}
        r["train"] = {**r["train"], "batch_size": 5, "max_steps": 4}
        r["eval"] = {"every": 2}
        r["checkpoints"] = {"every": None, "save_final": False, "save_best": False}
        one, two, p = one_and_two(tmp_path / reference, r)
        assert p.returncode == 0, p.stdout + p.stderr
        got = rows(two)
        assert any("rewards/margins" in x for x in got) and got[0]["world_size"] == 2
        # rewards are differences of log-probs of about -40: fp32 round-off of those
        same(rows(one), got, abs=2e-5)


def four_steps_as_one(runs, tmp_path, objective: dict, **train) -> list[dict]:
    """The runs' recipe with ``objective`` (and ``train`` keys) for 4 steps, evaluated at step 2,
    nothing saved: in one process and in two, which must log the same rows; the two's rows."""
    r = dict(runs["recipe"])
    r["objective"] = objective
    r["train"] = {**r["train"], **train, "max_steps": 4}
    r["eval"] = {"every": 2}
    r["checkpoints"] = {"every": None, "save_final": False, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    got = rows(two)
    assert got[0]["world_size"] == 2
    same(rows(one), got, abs=2e-5)
    return got


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_kto_feedback_trains_as_one(runs, tmp_path):
    """KTO: the reference point and the class means summed over the ranks' shares of each
    batch, so two processes log what one does."""
    from test_kto import feedback_rows

    from conftest import write_jsonl

    data = tmp_path / "feedback"
    write_jsonl(data / "train.jsonl", feedback_rows(40, 1))
    write_jsonl(data / "valid.jsonl", feedback_rows(9, 2))
    files = {"train": str(data / "train.jsonl"), "valid": str(data / "valid.jsonl")}
    kto = dict(runs, recipe={**runs["recipe"], "data": files})
    got = four_steps_as_one(kto, tmp_path, {"type": "kto", "beta": 0.5}, batch_size=6)
    assert any("kl" in x for x in got)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
@pytest.mark.parametrize(
    "objective",
    [
        {"mode": "offline", "top_k": 4, "teacher_logits": "precomputed"},
        {"mode": "gkd", "lmbda": 0.5, "seq_kd": True, "max_completion_length": 6},
        {"mode": "on_policy", "max_completion_length": 6},
    ],
    ids=["offline-precomputed", "gkd-drawn", "on-policy"],
)
def test_distillation_trains_as_one(runs, tmp_path, model_dir_factory, objective):
    """Distillation: the teacher's top-k read by each rank's rows, and completions drawn by
    the student and the teacher (every rank draws the batch, from the same keys), so two
    processes log what one does."""
    teacher = model_dir_factory("llama", intermediate_size=96)
    distill = {"type": "distill", "teacher": str(teacher), **objective}
    four_steps_as_one(runs, tmp_path, distill, batch_size=6)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_dft_trains_as_one(runs, tmp_path):
    """DFT: each rank's share of the tokens weighted by their own detached probabilities, summed
    as one process sums them."""
    got = four_steps_as_one(runs, tmp_path, {"type": "sft", "loss": "dft"})
    assert any("nll" in x for x in got)


def prompt_runs(runs, tmp_path, objective: dict, batch_size: int):
    """``objective`` on prompt rows (rewards with spread on a random model's completions), 4
    steps, in one process and under ``--nproc 2``: (the two-process run, its rows; the one
    process's rows), timings of generation left out."""
    from conftest import prompt_rows, write_jsonl

    data = tmp_path / "prompts"
    write_jsonl(data / "train.jsonl", prompt_rows(24, 1))
    write_jsonl(data / "valid.jsonl", prompt_rows(5, 2))
    r = dict(runs["recipe"])
    r["data"] = {"train": str(data / "train.jsonl"), "valid": str(data / "valid.jsonl")}
    r["objective"] = {
        **objective,
        "max_completion_length": 5,
        "rewards": [{"name": "regex", "pattern": "^.?[aeo]"}],
    }
    r["train"] = {**r["train"], "batch_size": batch_size, "max_steps": 4}
    r["eval"] = {"every": 2}
    r["checkpoints"] = {"every": None, "save_final": False, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    return two, untimed(two), untimed(one)


def untimed(run_dir):
    """A run's rows without generation's timings (each rank's own)."""
    drop = {"generation_s", "generation_tokens_per_sec"}
    return [{k: v for k, v in x.items() if k not in drop} for x in rows(run_dir)]


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
@pytest.mark.parametrize(
    "entropy_mask, extra",
    [
        (None, {}),
        (0.5, {}),
        (None, {"filter_groups": True, "importance_sampling_correction": "sequence"}),
    ],
    ids=["plain", "entropy-mask", "filtered-is"],
)
def test_grpo_groups_train_as_one(runs, tmp_path, entropy_mask, extra):
    """GRPO: each rank completes its share of a step's prompts with the rows' keys (from the
    seed and the step) and every rank gathers them all, so the completions are one process's;
    the groups split whole among the ranks; the held-out reward is summed over ranks. With an
    entropy mask, every rank takes the whole batch's quantile: the same update again. Group
    filtering decides from the gathered rewards and draws its extra prompts from the batch's
    seed on every rank; the sampler's log-probs are gathered with the completions."""
    objective = {"type": "grpo", "num_generations": 4, "beta": 0.05, **extra}
    if entropy_mask is not None:
        objective["entropy_mask"] = entropy_mask
    two, got, want = prompt_runs(runs, tmp_path, objective, batch_size=3)
    if extra:
        assert all("is_weight" in x and "filter_draws" in x for x in got if "loss" in x)
    assert got[0]["world_size"] == 2 and all(x["grad_norm"] > 1e-3 for x in got if "loss" in x)
    assert [x["eval_prompts"] for x in got if "eval_reward" in x] == [5, 5]
    assert "each of the 2 ranks completes its share" in (two / "log.txt").read_text()
    assert all(("entropy" in x) == bool(entropy_mask) for x in got if "loss" in x)
    same(want, got, abs=2e-5)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_sophia_estimates_curvature_over_every_rank(runs, tmp_path):
    """Each rank draws labels for its rows and the estimates are averaged: the two-process
    run trains as one process does (its first step exactly, the rest within 0.1%) and its
    checkpoint holds a curvature estimate for every weight."""
    import mlx.core as mx

    r = dict(runs["recipe"])
    r["optimizer"] = {"name": "sophia", "lr": 1e-3, "sophia": {"k": 2}}
    r["train"] = {**r["train"], "max_steps": 4}
    r["checkpoints"] = {"every": None, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = [x for x in rows(one) if "loss" in x], [x for x in rows(two) if "loss" in x]
    assert len(b) == 4 and a[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-5)
    # the ranks' draws are not one process's, but the clipped steps land close (seen: 1e-6)
    assert [x["loss"] for x in b] == pytest.approx([x["loss"] for x in a], rel=1e-3)
    state = mx.load(str(two / "checkpoints" / "final" / "optimizer.safetensors"))
    hs = [v for k, v in state.items() if k.endswith(".h")]
    assert hs and all(float(mx.abs(h).max()) > 0 for h in hs)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_online_dpo_pairs_train_as_one(runs, tmp_path):
    """Online DPO: the pairs are completed and ranked as in one process and split whole among
    the ranks (an odd number of pairs: one rank has more)."""
    _, got, want = prompt_runs(runs, tmp_path, {"type": "online_dpo", "beta": 0.5}, batch_size=5)
    assert got[0]["world_size"] == 2 and any(x.get("rewards/margins") for x in got)
    same(want, got, abs=2e-5)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_quantization_aware_training_trains_as_one(runs, tmp_path):
    """QAT (from step 2): every rank's layers fake-quantize alike, so two processes log what
    one does, the unquantized eval loss too."""
    qat = {"bits": 4, "group_size": 32, "start_step": 1}
    got = four_steps_as_one(runs, tmp_path, {"type": "sft"}, qat=qat)
    assert any("eval_loss_unquantized" in x for x in got)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_tool_rollouts_train_as_one(tmp_path):
    """Multi-turn rollouts with tools: each rank converses its share of the prompts (each row
    from its own key) and scores it, the ranks gather tokens, masks and rewards, and the
    two-process run logs what one process does."""
    from test_tool_runs import tool_recipe

    r = tool_recipe(tmp_path, {"beta": 0.05}, steps=3, sleepy=False)
    r["train"]["batch_size"] = 4
    r["checkpoints"] = {"every": None, "save_final": False, "save_best": False}
    one, two, p = one_and_two(tmp_path, r)
    assert p.returncode == 0, p.stdout + p.stderr
    got, want = untimed(two), untimed(one)
    assert got[0]["world_size"] == 2 and any(x.get("tool_calls", 0) > 0 for x in got)
    same(want, got, abs=2e-5)
