"""What a built run says about itself before it trains: the figures the recipe works out to
(``derived``), the resolved configuration written to config_resolved.json, and the header the
console prints."""

from __future__ import annotations

import importlib.metadata as md
import math
import platform

import mlx.core as mx

from .._version import __version__
from ..memory import GB


def versions() -> dict:
    """mlxtune's version and the installed versions of what a run's numbers depend on most."""
    found = {"mlxtune": __version__, "python": platform.python_version()}
    for package in ("mlx", "mlx-lm", "mlx-vlm"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            found[package] = None
    return found


def derived(trainer) -> dict:
    """Steps, epochs, sizes, data and device of a built ``Trainer``."""
    t, b = trainer.recipe.train, trainer.built
    train = trainer.train_set
    packed = trainer.recipe.data.packing != "off"
    per_epoch = trainer.batches_per_epoch  # None: a stream, not known before it is read
    if trainer.streamed:  # counted over its first window
        d = trainer.recipe.data
        capacity = d.pack_length or d.max_length
        rows = math.ceil(train.stats.tokens / capacity) if packed else len(train.examples)
    else:
        rows = per_epoch * t.batch_size if packed else len(train)
    mean_targets = train.stats.target_tokens / max(rows, 1)  # per row
    epochs = None if per_epoch is None else trainer.total_steps * t.grad_accumulation / per_epoch
    return {
        "effective_steps": trainer.total_steps,
        "epochs": None if epochs is None else round(epochs, 4),
        "batches_per_epoch": per_epoch,
        "examples_per_step": t.batch_size * t.grad_accumulation,
        "tokens_per_step": round(mean_targets * t.batch_size * t.grad_accumulation, 1),
        "trainable_parameters": b.trainable,
        "total_parameters": b.total_params,
        "trainable_percent": round(100 * b.trainable / max(b.total_params, 1), 4),
        "train_examples": None if trainer.streamed else len(train),
        "valid_examples": len(trainer.valid_set),
        "train_data": train.stats.line(),
        "valid_data": trainer.valid_set.stats.line(),
        "vocab_size": len(trainer.tokenizer._tokenizer),
        "adapted_modules": len(b.adapter_info["adapted"]),
        "estimated_peak_memory_gb": round(trainer.memory_estimate["total"] / GB, 3),
        "blas": trainer.blas.name,
        "device": str(mx.default_device()),
        **parallel(trainer),
    }


def parallel(trainer) -> dict:
    """The data-parallel layout: ranks and each one's share of a batch (nothing alone)."""
    world = trainer.world
    if world.size == 1:
        return {}
    ranks = trainer.engine.data_ranks  # tensor parallelism: every rank the whole batch
    return {
        "world_size": world.size,
        "distributed_backend": world.backend,
        "distributed_strategy": trainer.recipe.distributed.strategy,
        "batch_per_rank": -(-trainer.recipe.train.batch_size // ranks),
    }


def resolved(trainer) -> dict:
    """config_resolved.json: the recipe, where it came from, the model and the derived figures."""
    r, model_dir = trainer.recipe, trainer.built.model_dir
    return {
        "recipe": r.to_dict(),
        "recipe_file": r.source,
        "model_dir": str(model_dir) if model_dir else None,
        "model_config": trainer.model_config,
        "derived": derived(trainer),
        "auto": trainer.auto_sizes,
        "kernels": {
            "tiers": {op: str(tier) for op, tier in trainer.tiers.items()},
            **trainer.parts.kernel_table,
        },
        "versions": versions(),
    }


def header(trainer) -> list[str]:
    """The lines the console prints before training."""
    d, r = derived(trainer), trainer.recipe
    a = r.adapter
    kind = a.type if a.type == "full" else f"{a.type} r={a.rank} alpha={a.alpha}"
    model = trainer.built.model_dir or "new " + trainer.model_config["model_type"]
    adapted = f" in {d['adapted_modules']} linear layers" if d["adapted_modules"] else ""
    objective = r.objective.type
    return [
        f"run      {trainer.run_dir.path}" + ("  (dry run)" if trainer.dry_run else ""),
        f"model    {model}  ({d['total_parameters']:,} parameters, {r.model.dtype})",
        f"adapter  {kind}: {d['trainable_parameters']:,} trainable "
        f"({d['trainable_percent']:.2f}%){adapted}",
        f"data     train {d['train_data']}",
        f"         valid {d['valid_data']}",
        f"train    {d['effective_steps']} steps "
        + ("(streamed), " if d["epochs"] is None else f"({d['epochs']} epochs), ")
        + f"{trainer.objective.per_step(d['examples_per_step'])}, "
        f"{r.optimizer.name} lr {r.optimizer.lr:g} {r.schedule.name}"
        + ("" if objective == "sft" else f", objective {objective}"),
        f"backend  {d['device']}, BLAS: {d['blas']}",
        f"kernels  attention {trainer.tiers['attention']}, loss {trainer.tiers['loss']}",
    ] + (
        [
            f"parallel {d['world_size']} ranks ({d['distributed_backend']}, "
            f"{d['distributed_strategy']}), "
            + (
                f"about {d['batch_per_rank']} of the {r.train.batch_size} "
                f"{trainer.objective.noun} of a batch each"
                if d["batch_per_rank"] < r.train.batch_size
                else f"each on the whole batch of {r.train.batch_size}"
            )
        ]
        if "world_size" in d
        else []
    )
