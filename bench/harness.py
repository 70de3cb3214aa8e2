"""What the peer comparisons share (bench/compare_preference.py, bench/compare_grpo.py, and
bench/compare_kto.py through the first): the options both sides train with (``RunOptions``),
each trainer in a child process of its own, the model, the steady-state rates over the steps
whose shapes were compiled before, the peer's start (model, reference, LoRA, training
arguments, its timed ``train`` call), mlxtune's side as a recipe of LoRA on q_proj/v_proj with
mlx's Adam, the busy cores around a timed run, the tokenization check's lines, and the figures
every result carries. Each comparison file keeps what is its peer's own: its data, its
objective, what it records of a step.

Nothing here imports MLX at module level: a worker imports mlxtune first (``process_setup``), so
that mlxtune's OpenBLAS and malloc set-up come before mlx.core loads, for the peer too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULT_TAG = "MLX_LM_LORA_RESULT "
MLXTUNE_TAG = "MLXTUNE_RESULT "


# ---------------------------------------------------------------------------- processes
def child_spec(model_dir, rows, **kw) -> dict:
    """A worker's spec: the model folder (resolved), the training ``rows`` and ``kw`` as given
    (``RunOptions.spec()`` and the worker's own); a ValueError when the rows do not fill one
    batch of ``kw["batch_size"]``."""
    spec = dict(model_dir=str(Path(model_dir).resolve()), rows=list(rows), **kw)
    if len(spec["rows"]) < spec["batch_size"]:
        raise ValueError(f"{len(spec['rows'])} rows is fewer than one batch of {kw['batch_size']}")
    return spec


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


@dataclass(frozen=True)
class RunOptions:
    """What both sides of a comparison train with, every ``run_...`` function's first options:
    LoRA rank and scale (q_proj/v_proj, no dropout), ``batch_size`` pairs or prompts a step,
    ``steps``, Adam at the constant ``lr``, the objective's ``beta``, ``max_length`` tokens at
    most, the ``seed``, ``samples``: how many examples to return as encoded (for the tokenization
    check), and for the child process its ``timeout`` (seconds, None: none) and ``verbose``
    (its log shown on stderr)."""

    rank: int
    scale: float
    batch_size: int
    steps: int
    lr: float
    beta: float
    max_length: int
    seed: int = 0
    samples: int = 0
    timeout: float | None = None
    verbose: bool = False

    def spec(self) -> dict:
        """The options a worker reads (all but ``timeout`` and ``verbose``)."""
        return {k: v for k, v in asdict(self).items() if k not in ("timeout", "verbose")}


def run_options(args) -> RunOptions:
    """``RunOptions`` from the command line: ``add_arguments``' and the comparison's
    ``--batch``, ``--beta``, ``--max-length`` and ``--check`` (the samples)."""
    return RunOptions(
        rank=args.rank,
        scale=args.scale,
        batch_size=args.batch,
        steps=args.steps,
        lr=args.lr,
        beta=args.beta,
        max_length=args.max_length,
        seed=args.seed,
        samples=args.check,
        verbose=args.verbose,
    )


def comparison_model(args, tmp) -> tuple[Path, dict, int]:
    """The model both sides train: ``--model-dir``, else bench/lora_runs.py's tiny llama at
    ``--vocab``, built in the folder ``tmp``. (Its folder, its shape as ``lora_runs.model_shape``
    reads it less the vocabulary, the vocabulary.)"""
    import lora_runs  # here: it imports mlx (after mlxtune)

    model_dir = args.model_dir
    if model_dir is None:
        model_dir = lora_runs.build_base(Path(tmp) / f"tiny-{args.vocab}", args.vocab)
    shape = lora_runs.model_shape(Path(model_dir))
    return model_dir, shape, shape.pop("vocab_size")


# ---------------------------------------------------------------------------- timing
def steady_steps(shapes: list) -> tuple[list[int], list[int], int]:
    """(the steady steps: those after the first whose shape had been seen, i.e. compiled,
    before; every step after the first; how many shapes there were), steps by index."""
    seen: set = set()
    steady, after_first = [], []
    for i, shape in enumerate(shapes):
        new = shape not in seen
        seen.add(shape)
        if i == 0:
            continue
        after_first.append(i)
        if not new:
            steady.append(i)
    return steady, after_first, len(seen)


def steady_rates(shapes: list, step_s: list[float], batch: int, unit: str = "pairs") -> dict:
    """``unit`` per second from per-step seconds: over the steady steps (``steady_steps``; with
    none, over every step after the first), over every step after the first (``_with_compiles``),
    and ``batch`` / the median steady step (``_median``: less swayed by other work)."""
    if len(shapes) != len(step_s):
        raise ValueError(f"{len(shapes)} shapes for {len(step_s)} steps")
    idx, first, compiled = steady_steps(shapes)
    steady, after_first = [step_s[i] for i in idx], [step_s[i] for i in first]
    with_compiles = batch * len(after_first) / sum(after_first) if after_first else float("nan")
    return {
        f"{unit}_per_sec": batch * len(steady) / sum(steady) if steady else with_compiles,
        "steady_steps": len(steady),
        "compiled_shapes": compiled,
        f"{unit}_per_sec_median": batch / statistics.median(steady) if steady else None,
        f"{unit}_per_sec_with_compiles": with_compiles,
    }


def ids_differ(where: str, ours: list[int], peer: list[int]) -> str:
    """The tokenization check's line for token ids of the same text (``where``) that differ:
    both lengths and the first position where they part (the shorter's length: one is the
    other's start)."""
    j = next((k for k, (x, y) in enumerate(zip(ours, peer, strict=False)) if x != y), None)
    j = min(len(ours), len(peer)) if j is None else j
    return (
        f"{where}: token ids differ ({len(ours)} tokens in mlxtune, {len(peer)} in "
        f"mlx-lm-lora, first difference at {j})"
    )


def say_tokenization(compared: bool, mismatch: list[str], same: str) -> None:
    """The tokenization check's summary line on stderr: not ``compared`` (one side only), how
    many differences (``mismatch``, each said in a WARNING line before), or else ``same``."""
    if not compared:
        said = "not compared (one side only)"
    elif mismatch:
        said = f"{len(mismatch)} differences (the WARNING lines above)"
    else:
        said = same
    print(f"tokenization: {said}", file=sys.stderr)


# ---------------------------------------------------------------------------- the peer's side
def load_peer(spec: dict):
    """A peer worker's start, as mlx-lm-lora's CLI: the seeds (numpy's draws its batches, mlx's
    the sampling), the model and tokenizer (``mlx_lm.utils.load``, ``ensure_chat_template`` as
    its ``utils.from_pretrained``) and, for ``spec["reference"] == "copy"``, the reference as its
    ``train.load_reference_model`` (a second full load, frozen). (model, tokenizer, the
    reference or None.)"""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load
    from mlx_lm_lora.chat_template import ensure_chat_template

    np.random.seed(spec["seed"])
    mx.random.seed(spec["seed"])
    model, tokenizer = load(spec["model_dir"])
    ensure_chat_template(tokenizer)  # a no-op with a template
    ref_model = None
    if spec["reference"] == "copy":
        ref_model, _ = load(spec["model_dir"])
        ref_model.freeze()
    return model, tokenizer, ref_model


def peer_training_args(cls, spec: dict, **kw):
    """mlx-lm-lora's ``cls`` (a ``TrainingArgs``) as the bench runs it: ``spec``'s batch size,
    steps and length, a report every step (its it/s is that step's wall time), no validation, no
    evaluation or saving within the run, no gradient checkpointing; ``kw``: the objective's."""
    return cls(
        batch_size=spec["batch_size"],
        iters=spec["steps"],
        val_batches=0,
        steps_per_report=1,
        steps_per_eval=10**9,
        steps_per_save=10**9,
        max_seq_length=spec["max_length"],
        adapter_file=str(Path(spec["work_dir"]) / "adapters.safetensors"),
        grad_checkpoint=False,
        **kw,
    )


def train_peer(train, spec: dict, model, ref_model, dataset, args, callback, **kw):
    """``run_timed`` of ``train(...)``, mlx-lm-lora's trainer given the model, its reference,
    Adam at the constant ``spec["lr"]`` (the CLI's default), the training set, no validation
    set, ``args`` and ``callback``; ``kw``: the trainer's own arguments."""
    import mlx.optimizers as optim

    optimizer = optim.Adam(learning_rate=spec["lr"])
    return run_timed(
        lambda: train(
            model=model,
            ref_model=ref_model,
            optimizer=optimizer,
            train_dataset=dataset,
            val_dataset=None,
            args=args,
            training_callback=callback,
            **kw,
        )
    )


def peer_sizes(model, ref_model, setup: str) -> dict:
    """What every peer result carries: the policy's weights and the reference's own (0 where it
    has none of its own: ``ref_model`` None), the versions and the process set-up."""
    import mlx.core as mx

    return {
        "weights_gb": weight_bytes(model) / 1e9,
        "reference_weights_gb": (weight_bytes(ref_model) if ref_model is not None else 0) / 1e9,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "process_setup": setup,
    }


def weight_bytes(model) -> int:
    """The bytes of all of ``model``'s parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def trainable_params(model) -> int:
    """How many parameters ``model`` trains."""
    from mlx.utils import tree_flatten

    return int(sum(v.size for _, v in tree_flatten(model.trainable_parameters())))


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

    import mlxtune

    estimate = {k: round(v / 1e9, 4) for k, v in getattr(trainer, "memory_estimate", {}).items()}
    sys.stderr.write((trainer.run_dir.path / "log.txt").read_text())
    return {
        "trainer": f"mlxtune {getattr(mlxtune, '__version__', '')}".strip(),
        "peak_memory_gb": max(r["peak_memory_gb"] for r in rows),
        "kernels": dict(trainer.tiers),
        "trainable_params": trainable_params(trainer.model),
        "weights_gb": weight_bytes(trainer.model) / 1e9,
        "memory_estimate_gb": estimate,
        "summary_peak_memory_gb": summary.get("peak_memory_gb"),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": getattr(trainer.blas, "note", None),
    }


__all__ = [
    "MLXTUNE_TAG",
    "RESULT_TAG",
    "RunOptions",
    "add_arguments",
    "child_spec",
    "comparison_model",
    "worker_or_checked",
    "cpu_mark",
    "ids_differ",
    "in_child",
    "load_peer",
    "lora_adam_recipe",
    "mlxtune_figures",
    "other_cores",
    "peer_lora",
    "peer_sizes",
    "peer_training_args",
    "process_setup",
    "quiet_trainer",
    "report_recorder",
    "say_tokenization",
    "run_options",
    "start_timing",
    "steady_rates",
    "steady_steps",
    "train_peer",
    "trainable_params",
    "weight_bytes",
    "write_splits",
]
