"""What the peer comparisons share (bench/compare_preference.py, bench/compare_grpo.py, and
bench/compare_kto.py through the first): each trainer in a child process of its own, the LoRA
both sides train, mlxtune's side as a recipe of LoRA on q_proj/v_proj with mlx's Adam, the busy
cores around a timed run, and the figures every mlxtune result carries. Each comparison file
keeps what is its peer's own: its data, its objective, how it times a step.

Nothing here imports MLX at module level: a worker imports mlxtune first (``process_setup``), so
that mlxtune's OpenBLAS and malloc set-up come before mlx.core loads, for the peer too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_TAG = "MLX_LM_LORA_RESULT "
MLXTUNE_TAG = "MLXTUNE_RESULT "


# ---------------------------------------------------------------------------- processes
def in_child(script, flag: str, spec: dict, tag: str, what: str, timeout, verbose) -> dict:
    """Run ``script`` with ``flag SPEC.json`` in a new Python process (a temporary folder as its
    ``work_dir``) and return the JSON of its ``tag`` line; ``verbose`` shows its stderr."""
    script = Path(script).resolve()
    with tempfile.TemporaryDirectory(prefix=f"{script.stem.replace('_', '-')}-worker-") as tmp:
        spec = dict(spec, work_dir=tmp)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run(
            [sys.executable, str(script), flag, str(spec_path)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if verbose:
        sys.stderr.write(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(tag):
            return json.loads(line[len(tag) :])
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
    raise RuntimeError(f"{what} worker failed (exit {proc.returncode}):\n{tail}")


def process_setup() -> str:
    """mlxtune's import-time set-up (OpenBLAS for MLX's CPU backend, malloc thresholds), the
    same for the peer as for mlxtune: importing mlxtune runs it, before mlx.core loads."""
    import mlxtune  # noqa: F401

    return "mlxtune's import-time set-up (OpenBLAS, malloc thresholds)"


def cpu_mark() -> tuple[float, float, float] | None:
    """(the machine's busy CPU seconds, this process's CPU seconds, the wall clock), for
    ``other_cores``; None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system, time.perf_counter()


def other_cores(a, b) -> float | None:
    """Cores' worth of CPU the rest of the machine used, on average, between two ``cpu_mark``s
    (0 on a quiet machine; the timing is only comparable between runs with little of it)."""
    if a is None or b is None or b[2] <= a[2]:
        return None
    return round(max(0.0, (b[0] - a[0]) - (b[1] - a[1])) / (b[2] - a[2]), 2)


# ---------------------------------------------------------------------------- the command line
def add_arguments(ap, full_steps: int, quick_steps: int) -> None:
    """The options every peer comparison has: which sides run, the workers' hidden flags, the
    model, the steps, the LoRA (rank, scale, the peer's layers) and the learning rate."""
    ap.add_argument("--quick", action="store_true", help=f"{quick_steps} steps, not {full_steps}")
    ap.add_argument("--peer-only", action="store_true", help="run mlx-lm-lora's side alone")
    ap.add_argument("--mlxtune-only", action="store_true", help="run mlxtune's side alone")
    ap.add_argument("--peer-worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--mlxtune-worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help="an HF-layout model (default: the tiny llama)")
    ap.add_argument("--vocab", type=int, default=32768, help="the tiny llama's vocabulary")
    ap.add_argument("--steps", type=int, help=f"default {full_steps} ({quick_steps} with --quick)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scale", type=float, default=2.0)
    ap.add_argument(
        "--layers", type=int, default=-1, help="mlx-lm-lora: LoRA on the last N blocks (-1: all)"
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="show the workers' own logs")


def worker_or_checked(ap, args, peer_worker, mlxtune_worker, full_steps, quick_steps) -> bool:
    """Run the worker a hidden flag names (True: this process was one), else check the sides
    and settle the steps (False: the comparison goes on)."""
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return True
    if args.mlxtune_worker:
        mlxtune_worker(args.mlxtune_worker)
        return True
    if args.peer_only and args.mlxtune_only:
        ap.error("--peer-only and --mlxtune-only: pick one")
    if args.steps is None:
        args.steps = quick_steps if args.quick else full_steps
    return False


# ---------------------------------------------------------------------------- the peer's side
def run_timed(train) -> tuple[float, float, float | None]:
    """A peer trainer's whole ``train()`` call as the bench times it: Python's garbage and MLX's
    cache freed and its peak reset first, the trainer's own lines a step (tqdm.write, to stdout)
    sent to stderr, so stdout keeps the result line. (wall seconds, MLX's peak GB, the other
    cores' load meanwhile or None)."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    cpu0 = cpu_mark()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        train()
    finally:
        sys.stdout = real_stdout
    wall = time.perf_counter() - t0
    return wall, mx.get_peak_memory() / 1e9, other_cores(cpu0, cpu_mark())


def peer_lora(model, spec: dict) -> list[str]:
    """The peer's LoRA (returns the module keys it went on): mlx-lm's ``linear_to_lora_layers`` (what mlx-lm-lora's
    ``utils.from_pretrained`` calls) on every q_proj/v_proj of the last ``spec["layers"]``
    blocks, rank/scale as given, no dropout, over the frozen model."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    keys = sorted(
        k
        for k, _ in model.layers[0].named_modules()
        if k.rsplit(".", 1)[-1] in ("q_proj", "v_proj")
    )
    if not keys:
        raise SystemExit("no q_proj/v_proj modules in the model's blocks")
    linear_to_lora_layers(
        model,
        spec["layers"],
        {"rank": spec["rank"], "scale": spec["scale"], "dropout": 0.0, "keys": keys},
    )
    return keys


def report_recorder():
    """An mlx-lm ``TrainingCallback`` that keeps every training report (``.rows``)."""
    from mlx_lm.tuner.callbacks import TrainingCallback

    class Record(TrainingCallback):
        def __init__(self):
            self.rows: list[dict] = []

        def on_train_loss_report(self, info):
            self.rows.append(dict(info))

    return Record()


# ---------------------------------------------------------------------------- mlxtune's side
def write_splits(spec: dict) -> dict[str, Path]:
    """The worker's ``rows`` and ``valid_rows`` as train.jsonl and valid.jsonl in its folder."""
    work, files = Path(spec["work_dir"]), {}
    for name, key in (("train", "rows"), ("valid", "valid_rows")):
        files[name] = work / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in spec[key]))
    return files


def lora_adam_recipe(name: str, spec: dict, objective: dict) -> dict:
    """mlxtune's recipe for a peer comparison: ``spec``'s model, rows and sizes, LoRA on every
    block's q_proj/v_proj (no dropout, the peer's scale), mlx's Adam without bias correction (what
    mlx-lm-lora trains with) at a constant rate and no clipping, a metrics row a step, nothing
    saved, evaluation only at the end on one batch, and ``objective``."""
    files = write_splits(spec)
    return {
        "name": name,
        "model": {"path": spec["model_dir"], "dtype": spec["dtype"]},
        "data": {
            "train": str(files["train"]),
            "valid": str(files["valid"]),
            "max_length": spec["max_length"],
        },
        "objective": objective,
        "adapter": {
            "type": "lora",
            "rank": spec["rank"],
            "alpha": spec["scale"] * spec["rank"],  # LoRA's scale is alpha / rank
            "dropout": 0.0,
            "targets": ["q_proj", "v_proj"],
        },
        "optimizer": {
            "name": "adam",
            "lr": spec["lr"],
            "grad_clip": None,
            "bias_correction": False,
        },
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": spec["batch_size"],
            "max_steps": spec["steps"],
            "log_every": 1,  # a metrics row a step: its step_time_s is that step's wall time
            "progress": False,
            "seed": spec["seed"],
        },
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
    }


def quiet_trainer(recipe: dict, spec: dict):
    """(an mlxtune Trainer of ``recipe`` in the worker's folder, the seconds building it took)."""
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    t0 = time.perf_counter()
    run_dir = Path(spec["work_dir"]) / "run"
    trainer = Trainer(recipe_from_dict(recipe), run_dir=run_dir, console=Console(quiet=True))
    return trainer, time.perf_counter() - t0


def start_timing() -> None:
    """Before ``trainer.run()``: freed memory back, the peak reset (the loop resets it again
    right before its first step)."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def mlxtune_figures(trainer, rows: list[dict], summary: dict) -> dict:
    """What every mlxtune result carries: the training peak (its metrics rows' largest; the
    last row comes before the final evaluation), the plan's estimate, the model's sizes, the
    kernels, the versions, and the run's log on stderr (shown with --verbose)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxtune

    estimate = {k: round(v / 1e9, 4) for k, v in getattr(trainer, "memory_estimate", {}).items()}
    sys.stderr.write((trainer.run_dir.path / "log.txt").read_text())
    weights = sum(v.nbytes for _, v in tree_flatten(trainer.model.parameters()))
    trainable = sum(v.size for _, v in tree_flatten(trainer.model.trainable_parameters()))
    return {
        "trainer": f"mlxtune {getattr(mlxtune, '__version__', '')}".strip(),
        "peak_memory_gb": max(r["peak_memory_gb"] for r in rows),
        "kernels": dict(trainer.tiers),
        "trainable_params": int(trainable),
        "weights_gb": weights / 1e9,
        "memory_estimate_gb": estimate,
        "summary_peak_memory_gb": summary.get("peak_memory_gb"),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": getattr(trainer.blas, "note", None),
    }


__all__ = [
    "MLXTUNE_TAG",
    "RESULT_TAG",
    "add_arguments",
    "worker_or_checked",
    "cpu_mark",
    "in_child",
    "lora_adam_recipe",
    "mlxtune_figures",
    "other_cores",
    "peer_lora",
    "process_setup",
    "quiet_trainer",
    "report_recorder",
    "start_timing",
    "write_splits",
]
