"""Checkpoints: what one holds, how it is written, checked, found, pruned and resumed from,
and which recipe changes a resumed run can honour.

A checkpoint folder holds ``adapters.safetensors`` (the trainable weights, in mlx-lm's adapter
format, with its ``adapter_config.json``), ``optimizer.safetensors`` (the optimizer's whole
state: moments, step count, learning rate), ``masters.safetensors`` (the fp32 master weights,
with mixed precision), ``trainer_state.json`` (what the model is and came from, the recipe, and
a ``resume`` section: the ``TrainState``) and ``checksums.json`` (SHA-256 of every other file),
written last, so a checkpoint without it is incomplete. A checkpoint describes itself:
``load_trained`` rebuilds the trained model from it alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from pathlib import Path

import mlx.nn as nn

from .. import qat
from ..adapters import adapt_model
from ..config import OBJECTIVE_CONFIGS, QATConfig, Recipe
from ..engine.state import TrainState
from ..errors import UserInputError
from ..export import TrainedModel, load_trainable_weights, read_trainable, write_mlx_lm
from ..models import (
    VisionLM,
    add_reward_head,
    build_model,
    check_model_dir,
    has_reward_head,
    is_vision_config,
    load_model,
    load_vision_model,
    quantize_model,
    without_value_head,
)
from ..tokenizer import load_tokenizer
from .rundir import RunDir

CHECKSUMS = "checksums.json"

# Recipe keys a resumed run may change: how long to train and what to log, evaluate, sample,
# save and export. Anything else (model, data, adapter, optimizer, batch, seed, ...) would make
# the continued run a different run.
MAY_CHANGE = (
    "name",
    "run_dir",
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.progress",
    "eval.",
    "samples.",
    "checkpoints.",
    "export.",
    "kernels.",
    "precision.nonfinite",
    "precision.max_skipped",
    "memory.",
    "report",  # where the records also go: a reporter may join or leave a resumed run
    "train.grad_checkpointing",  # the same gradients (dropout masks are drawn differently)
    "distributed.",  # how ranks share the work: the same updates (checkpoints are whole)
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 of every file in ``folder`` (call it last)."""
    sums = {
        p.name: _sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != CHECKSUMS
    }
    (folder / CHECKSUMS).write_text(json.dumps(sums, indent=2))


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    sums_path = folder / CHECKSUMS
    if not sums_path.exists():
        return "no checksums.json (an incomplete write)"
    try:
        sums = json.loads(sums_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        sums = None
    if not isinstance(sums, dict):
        return "checksums.json is damaged"
    for name in ("trainer_state.json", "adapters.safetensors", "optimizer.safetensors"):
        if name not in sums:
            return f"{name} is missing (not a resumable checkpoint)"
    for name, digest in sums.items():
        p = folder / name
        if not p.exists():
            return f"{name} is missing"
        if _sha256(p) != digest:
            return f"{name} does not match its checksum (corrupt or truncated)"
        if not _readable(p):
            return f"{name} is damaged (it does not parse)"
    return None


def _readable(p: Path) -> bool:
    """Whether a checkpoint's file parses: a JSON file as an object, a safetensors file as its
    header (8-byte length, a JSON object) with every tensor's bytes inside the file."""
    try:
        if p.suffix == ".json":
            return isinstance(json.loads(p.read_text()), dict)
        if p.suffix != ".safetensors":
            return True
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n <= p.stat().st_size - 8 else None
        if not isinstance(header, dict):
            return False
        data = p.stat().st_size - 8 - n
        return all(k == "__metadata__" or max(v["data_offsets"]) <= data for k, v in header.items())
    except (OSError, ValueError, TypeError, KeyError):  # JSONDecodeError, UnicodeDecodeError
        return False


def candidates(run_dir: Path) -> list[Path]:
    """A run's checkpoints that could resume it, newest step first."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = []
    for c in folder.iterdir():
        if c.name.startswith(".") or not (c / "trainer_state.json").exists():
            continue
        try:
            step = json.loads((c / "trainer_state.json").read_text()).get("step", -1)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            step = -1
        found.append((step, c.name == "final", c))
    return [c for _, _, c in sorted(found, key=lambda x: (x[0], x[1]), reverse=True)]


def named(run_dir: Path, which: str) -> Path:
    """The checkpoint folder ``which`` names: a name in RUN_DIR/checkpoints, or a path to one of
    them; anything else (``../x``, another run's checkpoint) is refused."""
    folder = Path(run_dir) / "checkpoints"
    p = folder / which  # a name; an absolute path stays as it is
    if not p.exists() and Path(which).exists():
        p = Path(which)  # a path from the current directory
    try:
        ours = p.resolve().parent == folder.resolve()
    except (OSError, ValueError):  # a NUL byte, a symlink loop
        ours = False
    if not ours:
        raise UserInputError(
            f"not one of this run's checkpoints: name one in {folder} (for example "
            "step-000300), or give --resume alone for the newest",
            f"--resume {which}",
        )
    return p


def pick(run_dir: Path, which: str, warn) -> Path:
    """The checkpoint to resume from: ``which`` is "latest" (the newest intact one; damaged ones
    are skipped with a warning) or one of the run's checkpoint folders, by name or path (which
    must be intact)."""
    if which != "latest":
        p = named(run_dir, which)
        if not (p / "trainer_state.json").exists():
            raise UserInputError("not a checkpoint (no trainer_state.json)", str(p))
        return _intact(p, "cannot resume from it")
    found = candidates(run_dir)
    if not found:
        raise UserInputError("no checkpoint to resume from", str(run_dir / "checkpoints"))
    c = _first_intact(found, lambda c, why: warn(f"skipping checkpoint {c.name}: {why}"))
    if c is None:
        raise UserInputError("no intact checkpoint to resume from", str(run_dir / "checkpoints"))
    return c


def _intact(p: Path, refusal: str) -> Path:
    """``p``, which ``verify`` finds whole; refused otherwise (``refusal``: what cannot be
    done, before why)."""
    why = verify(p)
    if why:
        raise UserInputError(f"{refusal}: {why}", str(p))
    return p


def _first_intact(found: list[Path], skipped) -> Path | None:
    """The first of ``found`` that ``verify`` finds whole, each damaged one before it told to
    ``skipped(path, why)``; None when none is."""
    for c in found:
        why = verify(c)
        if why is None:
            return c
        skipped(c, why)
    return None


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(changes a resumed run honours, changes it cannot), as 'key: old -> new' lines. A key the
    saved recipe lacks (a section added to the schema since) counts at its default."""
    defaults = Recipe().to_dict()
    # the objective section's defaults are those of the saved objective's own section
    kind = (saved.get("objective") or {}).get("type", "sft")
    section = OBJECTIVE_CONFIGS.get(kind)
    defaults["objective"] = dataclasses.asdict(section()) if section is not None else {}
    a, b = {**_flat(defaults), **_flat(saved)}, _flat(now)
    ok, refused = [], []
    for key in sorted(set(a) | set(b)):
        if key == "source" or a.get(key) == b.get(key):
            continue
        line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        allowed = any(key == m or (m.endswith(".") and key.startswith(m)) for m in MAY_CHANGE)
        (ok if allowed else refused).append(line)
    return ok, refused


# ------------------------------------------------------------------------------ writing


def save(
    run_dir: RunDir,
    name: str,
    trained: TrainedModel,
    recipe: Recipe,
    engine,
    state: TrainState,
    loss: float,
    extra: dict | None = None,
    whole: tuple[dict, dict] | None = None,
) -> None:
    """Write checkpoint ``name`` of a run: the trainable weights, the engine's arrays
    (``engine.save``), and trainer_state.json with ``state`` as its ``resume`` section; staged,
    then checksummed and moved into place whole. ``whole``: a fully sharded run's (trainable
    weights, ``engine.checkpoint_arrays()``), gathered whole as they are written."""
    meta = {
        "step": state.position.step,
        "loss": loss,
        "lr": engine.optimizer.learning_rate.item(),  # the rate of the last step taken
        "time": time.time(),
        **(extra or {}),
    }
    t = trained
    info = {
        **meta,
        "base_model_dir": str(Path(t.base_dir).resolve()) if t.base_dir else None,
        "tokenizer_dir": str(Path(t.tokenizer_dir).resolve()) if t.tokenizer_dir else None,
        "model_config": t.model_config,
        "dtype": recipe.model.dtype,
        "adapter": t.adapter,
        "recipe": recipe.to_dict(),
        "resume": state.to_json(),
    }
    with run_dir.staged("checkpoints", name) as tmp:
        weights, arrays = whole or (None, None)
        write_mlx_lm(t, tmp, meta, weights)
        engine.save(tmp, arrays)
        (tmp / "trainer_state.json").write_text(json.dumps(info, indent=2))
        write_checksums(tmp)


def prune(run_dir: RunDir, keep_last: int) -> None:
    """Remove all but the newest ``keep_last`` step checkpoints (best and final stay)."""
    steps = sorted(p for p in run_dir.checkpoints.iterdir() if p.name.startswith("step-"))
    for p in steps[:-keep_last]:
        shutil.rmtree(p)


def best_checkpoint(run_dir: RunDir) -> tuple[Path | None, dict]:
    """checkpoints/best and its trainer_state.json (step, evaluation), or (None, {})."""
    best = run_dir.checkpoints / "best"
    if not (best / "trainer_state.json").exists():
        return None, {}
    return best, json.loads((best / "trainer_state.json").read_text())


def last_saved(run_dir: RunDir) -> str:
    """The newest step checkpoint, as a path in the run directory, or "none saved yet"."""
    folder = run_dir.checkpoints
    steps = sorted(c.name for c in folder.glob("step-*") if c.is_dir()) if folder.exists() else []
    return f"checkpoints/{steps[-1]}" if steps else "none saved yet"


# ------------------------------------------------------------------------------ resuming


def restore(
    run_dir: RunDir,
    which: str,
    recipe: Recipe,
    engine,
    log,
    trim: bool = True,
    total_steps: int | None = None,
) -> TrainState:
    """Put back the weights, the engine's state and the random state of checkpoint ``which``
    ("latest" or a name), cut metrics and samples back to its step (``trim``: not on the ranks of
    a data-parallel run that do not write the run), and return its ``TrainState``.
    ``log(message)`` hears of skipped checkpoints and honoured recipe changes; a checkpoint
    already at ``total_steps`` (the recipe's last step) is refused before anything is touched."""
    ckpt = pick(run_dir.path, which, lambda m: log(f"WARNING: {m}"))
    info = json.loads((ckpt / "trainer_state.json").read_text())
    if info.get("resume") is None:
        raise UserInputError("this checkpoint holds no resume state", str(ckpt))
    ok, refused = recipe_changes(info.get("recipe", {}), recipe.to_dict())
    if refused:
        raise UserInputError(
            "the recipe changed in ways a resumed run cannot honour: " + "; ".join(refused),
            refused[0].split(":")[0],
        )
    for line in ok:
        log(f"resuming with a changed recipe: {line}")
    state = TrainState.from_json(info["resume"])
    step = state.position.step
    if total_steps is not None and step >= total_steps:
        raise UserInputError(
            f"this checkpoint is at step {step} and the recipe ends at step {total_steps}: "
            "nothing is left to train (raise train.max_steps or train.epochs to go on)",
            str(ckpt),
        )
    engine.restore(ckpt, state.engine)
    for name in ("metrics.jsonl", "samples.jsonl") if trim else ():
        rows = run_dir.read_jsonl(name)
        if rows:
            kept = [row for row in rows if row.get("step", 0) <= step]
            run_dir.write_text(name, "".join(json.dumps(r) + "\n" for r in kept))
    log(f"resumed from checkpoints/{ckpt.name} at step {step}")
    return state


# ------------------------------------------------------------------------------ reading


def find_checkpoint(path: str | Path, warn=None) -> Path:
    """An intact checkpoint directory: PATH itself, or a run directory's final, else best, else
    newest step (``candidates``). A damaged one (``verify``) is refused when named,
    and skipped, through ``warn(message)``, when picked from a run."""
    p = Path(path)
    if (p / "trainer_state.json").exists():
        return _intact(p, "cannot read this checkpoint")
    found = candidates(p)
    if not found:
        raise UserInputError(
            "not a run directory or checkpoint (no trainer_state.json found)", str(p)
        )
    rank = {"final": 0, "best": 1}
    c = _first_intact(
        sorted(found, key=lambda c: rank.get(c.name, 2)),  # stable: newest step first
        lambda c, why: warn is not None and warn(f"WARNING: skipping {c}: {why}"),
    )
    if c is None:
        raise UserInputError("no intact checkpoint in this run", str(p / "checkpoints"))
    return c


def load_trained(path: str | Path, warn=None) -> TrainedModel:
    """Rebuild the trained model a run directory or checkpoint describes (``find_checkpoint``)."""
    return load_checkpoint(find_checkpoint(path, warn))


def base_model(state: dict, lazy: bool = False) -> tuple[nn.Module, dict]:
    """The model a checkpoint's run started from (``state``: its trainer_state.json), as the
    run loaded it: its base directory (a GGUF's quantized tensors kept under LoRA/DoRA, QLoRA's
    quantization applied again), or a new model of its config for a run from scratch.
    ``lazy``: a base directory's weights are not read yet (``load_model``'s ``lazy``)."""
    base = Path(state["base_model_dir"]) if state.get("base_model_dir") else None
    saved = (state.get("recipe") or {}).get("model") or {}
    # the run's recipe allowed the model's own code (or did not): so does its export
    trust = bool(saved.get("trust_remote_code"))
    if base is None:
        cfg = state["model_config"]
        return build_model(cfg, cfg["vocab_size"], state.get("dtype", "float32"))
    if base.is_dir() and is_vision_config(config := check_model_dir(base, trust)):
        return load_vision_model(base, config, state.get("dtype", "float32"), trust), config
    keep = state["adapter"]["type"] in ("lora", "dora", qat.LEARNED) and not saved.get(
        "dequantize", False
    )
    objective = (state.get("recipe") or {}).get("objective") or {}
    # then quantized as it is read (a dense base is never held whole): QLoRA's base, or the
    # student of a learned quantization
    q = saved.get("quantize") or objective.get("student_quantization")
    model, config = load_model(
        base, state.get("dtype", "float32"), trust, keep, lazy=lazy or bool(q)
    )
    if q:  # QLoRA: the adapters were trained over the quantized base
        quantize_model(model, q["bits"], q["group_size"], evaluate=not lazy)
    return model, config


def load_checkpoint(ckpt: Path, lazy: bool = False) -> TrainedModel:
    """Rebuild the trained model of a checkpoint ``find_checkpoint`` has found and checked.
    ``lazy``: the base's weights are read only when something computes with them (an export
    that writes one weight at a time and drops each: ``export(..., consume=True)``)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if "model_config" not in state:
        raise UserInputError(
            "this checkpoint does not describe its model (written by an older mlxtune)", str(ckpt)
        )
    base = Path(state["base_model_dir"]) if state.get("base_model_dir") else None
    trust = bool(((state.get("recipe") or {}).get("model") or {}).get("trust_remote_code"))
    a = state["adapter"]
    model, config = base_model(state, lazy)
    if a["type"] == qat.LEARNED:  # the quantized layers' scales and biases trained
        qat.learn_scales(model)
    else:
        adapt_model(  # as it trained (a vision model's tower frozen but where adapted)
            model,
            a["type"],
            a.get("rank", 8),
            a.get("alpha", 16.0),
            0.0,
            a.get("targets", []),
            a.get("layers"),
            a.get("rslora", False),
        )
    q = ((state.get("recipe") or {}).get("train") or {}).get("qat")
    if q:  # trained quantization-aware: its layers as they trained (what exports quantize)
        qat.prepare(model, QATConfig(**q))
    weights = without_value_head(read_trainable(ckpt))  # a policy needs no critic
    if has_reward_head(weights):  # a reward model
        add_reward_head(model, int(config["hidden_size"]))
    load_trainable_weights(model, weights, str(ckpt / "adapters.safetensors"))
    tok_dir = Path(state["tokenizer_dir"]) if state.get("tokenizer_dir") else base
    template = ((state.get("recipe") or {}).get("tokenizer") or {}).get("chat_template")
    tokenizer = (  # as the run read it: its chat template, its trust in the folder's code
        load_tokenizer(tok_dir, chat_template=template, trust_remote_code=trust)
        if tok_dir is not None
        else None
    )
    if isinstance(model, VisionLM) and tokenizer is not None:  # its data's images read as trained
        tokenizer.image_tokens = model.image_tokens
    model.eval()
    learned = ((state.get("recipe") or {}).get("objective") or {}).get("student_quantization")
    q = q or learned  # the format its quantized exports keep
    spec = qat.Spec(q["bits"], q["group_size"], q.get("mode", "affine")).as_dict() if q else None
    return TrainedModel(model, tokenizer, config, a, base, tok_dir, spec)
