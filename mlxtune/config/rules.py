"""Rules across a recipe's fields: values and combinations that cannot run, refused naming the
key (the keys that the other settings make meaningless are ``inert``'s: reported, not refused).

``check_values`` runs one ``check_SECTION`` function per section, in the order of the sections;
a rule that involves two sections lives with the key it blames.
"""

from __future__ import annotations

import importlib.util
from typing import Any, NoReturn, Protocol

from ..data import format_names
from ..export.gguf.codes import refusal as gguf_refusal
from ..qat import check as qat_refusal
from ..safety import NOT_PLAIN, NOT_UNDER_HERE, is_plain_name, is_under_here
from .schema import Recipe

PREFERENCE = ("dpo", "orpo", "cpo", "reward")
"""The objectives that train on preference pairs."""


class Fails(Protocol):
    """What the rules report a problem to: ``fail`` raises a ``UserInputError`` naming where
    the key was set (file and line, or the override)."""

    def fail(self, key: str, msg: str) -> NoReturn: ...


def show_value(v: Any) -> str:
    """A value as a message shows it: strings quoted, mappings and lists by their kind."""
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, (dict, list)):
        return type(v).__name__
    return repr(v)


def _positive(v: Fails, key: str, x, allow_none: bool = False) -> None:
    if x is None and allow_none:
        return
    if x is None or x <= 0:
        v.fail(key, f"must be greater than 0, got {x}")


def _in_range(v: Fails, key: str, x, lo: float, hi: float, hi_open: bool = True) -> None:
    if x < lo or (x >= hi if hi_open else x > hi):
        bracket = ")" if hi_open else "]"
        v.fail(key, f"must be in [{lo}, {hi}{bracket}, got {x}")


# --------------------------------------------------------------------------------------------
# Refused values and combinations, one function per section


def check_values(r: Recipe, v: Fails) -> None:
    """Refuse impossible values and combinations, section by section."""
    check_run(r, v)
    check_model(r, v)
    check_tokenizer(r, v)
    check_data(r, v)
    check_adapter(r, v)
    check_optimizer(r, v)
    check_schedule(r, v)
    check_train(r, v)
    check_eval(r, v)
    check_samples(r, v)
    check_precision(r, v)
    check_memory(r, v)
    check_distributed(r, v)
    check_checkpoints(r, v)
    check_export(r, v)
    check_report(r, v)
    check_objective(r, v)


def check_objective(r: Recipe, v: Fails) -> None:
    """The objective's own values (``ObjectiveConfig.checks``)."""
    o = r.objective
    for ok, key, what in o.checks():
        if not ok:
            v.fail(f"objective.{key}", f"must be {what}, got {show_value(getattr(o, key))}")
    if getattr(o, "student_quantization", None) is not None:
        _check_learned_quantization(r, v)


def _check_learned_quantization(r: Recipe, v: Fails) -> None:
    """objective.student_quantization: an affine format, and nothing else that decides what
    trains or how the model is quantized."""
    q, key = r.objective.student_quantization, "objective.student_quantization"
    why = qat_refusal(q.bits, q.group_size, "affine")
    if why is not None:
        v.fail(f"{key}.bits" if "bits" in why else f"{key}.group_size", why)
    if any(k == "adapter" or k.startswith("adapter.") for k in r.explicit):
        v.fail(
            "adapter",
            "learned quantization trains the quantized student's scales and biases (its codes "
            "ship as they are); leave the adapter section out",
        )
    if any(f != "fused" for f in r.export.formats):
        v.fail(
            "export.formats",
            "a learned quantization ships as its quantized model: fused (GGUF's types round "
            "its learned scales differently; it has no adapter)",
        )
    for other, what in (("model.quantize", r.model.quantize), ("train.qat", r.train.qat)):
        if what is not None:
            v.fail(other, f"{key} quantizes the student itself; leave {other} out")


def check_run(r: Recipe, v: Fails) -> None:
    """The top-level keys: name and run_dir stay under the current directory."""
    if not is_plain_name(r.name):
        v.fail("name", f"{r.name!r} {NOT_PLAIN}")
    if r.run_dir is not None and not is_under_here(r.run_dir):
        v.fail("run_dir", f"{r.run_dir!r} {NOT_UNDER_HERE}")


def check_model(r: Recipe, v: Fails) -> None:
    """model: a path or an architecture, and what quantizing or training from scratch needs."""
    if r.model.path is None and r.model.arch is None:
        v.fail(
            "model",
            "give model.path (a model directory or Hub id) or model.arch (train from scratch)",
        )
    if r.model.path is not None and r.model.arch is not None:
        v.fail("model.arch", "give model.path or model.arch, not both")
    q = r.model.quantize
    if q is not None:
        for name in ("bits", "group_size"):
            if not isinstance(getattr(q, name), int):
                v.fail(f"model.quantize.{name}", f"expected an integer, got {getattr(q, name)!r}")
        if r.model.arch is not None:
            v.fail(
                "model.quantize",
                "is for a loaded base (model.path); a model built from arch trains every weight",
            )
        if r.adapter.type == "full":
            v.fail(
                "model.quantize",
                "quantized weights cannot train: use adapter.type lora or dora (QLoRA)",
            )
    if r.model.arch is not None:
        if "model_type" not in r.model.arch:
            v.fail("model.arch", "needs model_type (for example llama)")
        if r.adapter.type != "full":
            v.fail("adapter.type", "a model trained from scratch needs adapter.type: full")


def check_tokenizer(r: Recipe, v: Fails) -> None:
    """tokenizer: a model built from arch brings none, and the trainer's settings."""
    if r.model.arch is not None and r.tokenizer.train is None and r.tokenizer.path is None:
        v.fail("tokenizer", "a model built from arch needs tokenizer.path or tokenizer.train")
    t = r.tokenizer.train
    if t is not None:
        _positive(v, "tokenizer.train.vocab_size", t.vocab_size)
        _positive(v, "tokenizer.train.max_sentences", t.max_sentences)
        _in_range(v, "tokenizer.train.character_coverage", t.character_coverage, 0.9, 1.0, False)


def check_data(r: Recipe, v: Fails) -> None:
    """data: lengths, shares, and what packing needs."""
    d = r.data
    if not d.train:
        v.fail("data.train", "a training file is required")
    if d.format != "auto" and d.format not in format_names():
        known = ", ".join(["auto", *format_names()])
        v.fail("data.format", f"unknown format {d.format!r}; known: {known}")
    if d.max_length == "auto":
        if d.packing != "off":
            v.fail(
                "data.max_length", "auto is for unpacked rows (data.packing: off); give a number"
            )
    else:
        _positive(v, "data.max_length", d.max_length)
    if d.min_length < 0:
        v.fail("data.min_length", f"must be 0 or more, got {d.min_length}")
    _in_range(v, "data.valid_fraction", d.valid_fraction, 0.0, 1.0)
    for key in ("valid_size", "test_size"):
        size = getattr(d, key)
        if size is None:
            continue
        if isinstance(size, bool) or not (
            (isinstance(size, int) and size >= 1) or (isinstance(size, float) and 0 < size < 1)
        ):
            v.fail(
                f"data.{key}",
                f"a fraction between 0 and 1 (0.05) or a number of examples (200), got {size!r}",
            )
    if d.valid_size is not None and "data.valid_fraction" in r.explicit:
        v.fail("data.valid_size", "give data.valid_size or data.valid_fraction, not both")
    _in_range(v, "data.max_bad_fraction", d.max_bad_fraction, 0.0, 1.0)
    if d.num_proc != "auto" and d.num_proc < 1:
        v.fail("data.num_proc", f"must be auto or 1 or more, got {d.num_proc}")
    for want, have in (d.columns or {}).items():
        if not isinstance(want, str) or not isinstance(have, str):
            v.fail("data.columns", f"maps a field name to a column name, got {want!r}: {have!r}")
    _positive(v, "data.bucket_size", d.bucket_size)
    _positive(v, "data.pad_to_multiple", d.pad_to_multiple)
    if d.pack_length is not None:
        if d.pack_length < 2:
            v.fail("data.pack_length", f"a row needs at least 2 tokens, got {d.pack_length}")
        if d.packing == "off":
            v.fail("data.pack_length", "is for packed rows; set data.packing: pack or stream")
        if d.packing == "pack" and d.pack_length < d.max_length:
            v.fail(
                "data.pack_length",
                f"must hold the longest example (data.max_length {d.max_length}), "
                f"got {d.pack_length}",
            )
    if d.packing == "stream" and d.pack_length is None and d.max_length < 2:
        v.fail("data.max_length", "stream rows (max_length long) need at least 2 tokens")
    if d.packing != "off" and r.kernels.attention == "off":
        v.fail("data.packing", "packed rows need mlxtune's attention (kernels.attention not off)")
    if d.streaming:
        _check_streaming(r, v)
    elif "data.stream_window" in r.explicit:
        _positive(v, "data.stream_window", d.stream_window)


def _check_streaming(r: Recipe, v: Fails) -> None:
    """data.streaming: what a stream of unknown length needs."""
    d = r.data
    _positive(v, "data.stream_window", d.stream_window)
    if r.objective.type != "sft":
        v.fail(
            "data.streaming",
            f"streams SFT data (text, completion or chat rows), not objective.type "
            f"{r.objective.type}'s",
        )
    if r.train.max_steps is None:
        v.fail(
            "data.streaming",
            "a stream's length is unknown until it is read: give train.max_steps, not epochs",
        )
    if d.max_length == "auto":
        v.fail("data.max_length", "auto reads every example first; a stream needs a number")
    if r.tokenizer.train is not None:
        v.fail("data.streaming", "tokenizer.train reads all the data first; give a tokenizer")
    for key in ("valid_size", "test_size"):
        size = getattr(d, key)
        if isinstance(size, float):
            v.fail(
                f"data.{key}",
                f"a stream's size is unknown, so a fraction ({size}) of it cannot be held out; "
                "give a number of rows (its first rows are held out)",
            )
    if d.valid is None and d.valid_size is None:
        v.fail(
            "data.streaming",
            "a stream's size is unknown, so data.valid_fraction cannot hold a share of it out: "
            "give data.valid, or data.valid_size as a number of rows (the stream's first rows)",
        )


def check_adapter(r: Recipe, v: Fails) -> None:
    """adapter: LoRA/DoRA settings, starting from an adapter, and which layers."""
    a = r.adapter
    if a.type in ("lora", "dora"):
        _positive(v, "adapter.rank", a.rank)
        _positive(v, "adapter.alpha", a.alpha)
        _in_range(v, "adapter.dropout", a.dropout, 0.0, 1.0)
        if not a.targets:
            v.fail("adapter.targets", "name at least one layer (for example q_proj) or all-linear")
        _positive(v, "adapter.lora_plus_ratio", a.lora_plus_ratio, allow_none=True)
    if a.init_from is not None and a.type == "full":
        v.fail("adapter.init_from", "starting from an adapter needs adapter.type lora or dora")
    _check_layers(a.layers, v)


def _check_layers(layers, v: Fails) -> None:
    if layers is None or layers == "all":
        return
    if isinstance(layers, bool):
        v.fail("adapter.layers", f"expected null, N, 'a-b' or a list, got {layers!r}")
    if isinstance(layers, int):
        if layers <= 0:
            v.fail("adapter.layers", f"must be greater than 0, got {layers}")
        return
    if isinstance(layers, str):
        parts = layers.split("-")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            if int(parts[0]) > int(parts[1]):
                v.fail("adapter.layers", f"range {layers!r} is empty")
            return
        v.fail("adapter.layers", f"expected 'a-b' (for example '0-11'), got {layers!r}")
    if isinstance(layers, list):
        if not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
        ):
            v.fail("adapter.layers", "a list of layer indices (integers 0 or more)")
        return
    v.fail("adapter.layers", f"expected null, N, 'a-b' or a list, got {show_value(layers)}")


def check_optimizer(r: Recipe, v: Fails) -> None:
    """optimizer: learning rate, Adam's betas and eps, weight decay, clipping."""
    o = r.optimizer
    _positive(v, "optimizer.lr", o.lr)
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        v.fail("optimizer.betas", f"must be two numbers in [0, 1), got {o.betas}")
    _positive(v, "optimizer.eps", o.eps)
    if o.weight_decay < 0:
        v.fail("optimizer.weight_decay", f"must be 0 or more, got {o.weight_decay}")
    if o.name == "adam" and o.weight_decay > 0:
        v.fail("optimizer.weight_decay", "adam has no weight decay; use name: adamw")
    _positive(v, "optimizer.grad_clip", o.grad_clip, allow_none=True)
    a = o.adafactor
    if len(a.eps) != 2 or not all(e > 0 for e in a.eps):
        v.fail("optimizer.adafactor.eps", f"must be two numbers above 0, got {a.eps}")
    _positive(v, "optimizer.adafactor.clip_threshold", a.clip_threshold)
    if not a.decay_rate < 0:
        v.fail(
            "optimizer.adafactor.decay_rate",
            f"must be below 0 (the second moment's decay 1 - t^decay_rate), got {a.decay_rate}",
        )
    if a.beta1 is not None and not 0 <= a.beta1 < 1:
        v.fail("optimizer.adafactor.beta1", f"must be in [0, 1) or null, got {a.beta1}")
    m = o.muon
    _positive(v, "optimizer.muon.lr_scale", m.lr_scale)
    if m.weight_decay_scale < 0:
        v.fail(
            "optimizer.muon.weight_decay_scale", f"must be 0 or more, got {m.weight_decay_scale}"
        )
    _in_range(v, "optimizer.muon.momentum", m.momentum, 0, 1)
    if m.ns_steps < 1:
        v.fail("optimizer.muon.ns_steps", f"must be 1 or more, got {m.ns_steps}")
    sg = o.sophia
    if len(sg.betas) != 2 or not all(0 <= b < 1 for b in sg.betas):
        v.fail("optimizer.sophia.betas", f"must be two numbers in [0, 1), got {sg.betas}")
    _positive(v, "optimizer.sophia.rho", sg.rho)
    _positive(v, "optimizer.sophia.k", sg.k)
    _positive(v, "optimizer.sophia.eps", sg.eps)


def check_schedule(r: Recipe, v: Fails) -> None:
    """schedule: warmup and the floor the decaying schedules end at."""
    s, lr = r.schedule, r.optimizer.lr
    if s.warmup_steps is not None and s.warmup_steps < 0:
        v.fail("schedule.warmup_steps", f"must be 0 or more, got {s.warmup_steps}")
    if s.min_lr < 0 or s.min_lr > lr:
        v.fail("schedule.min_lr", f"must be between 0 and optimizer.lr ({lr}), got {s.min_lr}")
    if not 0 < s.decay_fraction <= 1:
        v.fail("schedule.decay_fraction", f"must be in (0, 1], got {s.decay_fraction}")


def check_train(r: Recipe, v: Fails) -> None:
    """train: batch sizes, how long, label smoothing, gradient checkpointing."""
    t = r.train
    if t.batch_size != "auto":
        _positive(v, "train.batch_size", t.batch_size)
    _positive(v, "train.grad_accumulation", t.grad_accumulation)
    _positive(v, "train.log_every", t.log_every)
    if t.max_steps is None and t.epochs is None:
        v.fail("train", "give train.max_steps or train.epochs")
    _positive(v, "train.max_steps", t.max_steps, allow_none=True)
    _positive(v, "train.epochs", t.epochs, allow_none=True)
    _in_range(v, "train.label_smoothing", t.label_smoothing, 0.0, 1.0)
    _positive(v, "train.neftune_noise_alpha", t.neftune_noise_alpha, allow_none=True)
    gc = t.grad_checkpointing
    if gc != "auto" and not isinstance(gc, bool) and gc < 1:
        v.fail("train.grad_checkpointing", f"true, false or every k-th layer (k >= 1), got {gc}")
    if t.qat is not None:
        _check_qat(r, v)
    es = t.early_stopping
    _positive(v, "train.early_stopping.patience", es.patience, allow_none=True)
    if es.min_delta < 0:
        v.fail("train.early_stopping.min_delta", f"must be 0 or more, got {es.min_delta}")
    if not es.metric.startswith("eval_"):
        v.fail("train.early_stopping.metric", f"an evaluation metric (eval_...), got {es.metric!r}")
    if es.patience is not None and r.eval.every is None:
        v.fail(
            "train.early_stopping.patience",
            "early stopping checks at each evaluation: set eval.every",
        )


def _check_qat(r: Recipe, v: Fails) -> None:
    """train.qat: a format MLX quantizes to, and what else the run does that QAT cannot
    match."""
    q = r.train.qat
    why = qat_refusal(q.bits, q.group_size, q.mode)
    if why is not None:
        v.fail("train.qat.bits" if "bits" in why else "train.qat.group_size", why)
    if q.start_step < 0:
        v.fail("train.qat.start_step", f"must be 0 or more, got {q.start_step}")
    if r.adapter.type != "full" and r.adapter.dropout:
        v.fail(
            "adapter.dropout",
            "must be 0 with train.qat: QAT computes with the merged weight (base + update), "
            "and LoRA's dropout acts on the update's input alone",
        )
    if r.distributed.strategy != "data":
        v.fail(
            "train.qat",
            f"trains with distributed.strategy data (its layers are not divided among ranks "
            f"yet), got {r.distributed.strategy}",
        )
    base = r.model.quantize
    if base is not None and (base.bits, base.group_size, q.mode) != (
        q.bits,
        q.group_size,
        "affine",
    ):
        v.fail(
            "train.qat",
            f"over a quantized base (model.quantize: {base.bits} bits, groups of "
            f"{base.group_size}) QAT trains toward the same format, so that the layers it "
            "leaves quantized ship as they are: set bits, group_size and mode affine alike",
        )


def check_eval(r: Recipe, v: Fails) -> None:
    """eval: how often, how much, and the exact-match metric."""
    e = r.eval
    _positive(v, "eval.every", e.every, allow_none=True)
    _positive(v, "eval.max_batches", e.max_batches, allow_none=True)
    _positive(v, "eval.batch_size", e.batch_size, allow_none=True)
    if e.exact_match < 0:
        v.fail("eval.exact_match", f"must be 0 or more, got {e.exact_match}")
    _positive(v, "eval.max_new_tokens", e.max_new_tokens)


def check_samples(r: Recipe, v: Fails) -> None:
    """samples: how often, how many, how long, how random."""
    s = r.samples
    _positive(v, "samples.every", s.every, allow_none=True)
    _positive(v, "samples.max_new_tokens", s.max_new_tokens)
    _positive(v, "samples.count", s.count)
    if s.temperature < 0:
        v.fail("samples.temperature", f"must be 0 or more, got {s.temperature}")


def check_precision(r: Recipe, v: Fails) -> None:
    """precision: the loss scale's start, growth and floor, and non-finite steps."""
    p = r.precision
    _positive(v, "precision.init_scale", p.init_scale)
    if p.growth_factor <= 1:
        v.fail("precision.growth_factor", f"must be greater than 1, got {p.growth_factor}")
    _in_range(v, "precision.backoff_factor", p.backoff_factor, 0.0, 1.0)
    if p.backoff_factor == 0:
        v.fail("precision.backoff_factor", "must be greater than 0, got 0.0")
    _positive(v, "precision.growth_interval", p.growth_interval)
    _positive(v, "precision.min_scale", p.min_scale)
    if p.min_scale > p.init_scale:
        v.fail(
            "precision.min_scale", f"must not exceed init_scale ({p.init_scale}), got {p.min_scale}"
        )
    _positive(v, "precision.max_skipped", p.max_skipped)


SPLIT_OPTIMIZERS = ("adamw", "adam", "lion", "sgd")
"""Optimizers that can update a weight of which a rank holds only a part (distributed.strategy
fsdp or tensor): each updates a weight value by value."""


def check_distributed(r: Recipe, v: Fails) -> None:
    """distributed: the wait on the other ranks; what the strategies that divide the weights
    can train."""
    t = r.distributed.timeout_s
    if t not in ("auto", None) and (isinstance(t, bool) or t <= 0):
        v.fail("distributed.timeout_s", f"auto, null or a number of seconds above 0, got {t!r}")
    strategy = r.distributed.strategy
    if strategy != "data" and r.optimizer.name not in SPLIT_OPTIMIZERS:
        v.fail(
            "optimizer.name",
            f"one of {', '.join(SPLIT_OPTIMIZERS)} with distributed.strategy: {strategy} (each "
            f"rank updates only its part of a weight; {r.optimizer.name} reads whole matrices "
            "or blocks of values across them), got " + repr(r.optimizer.name),
        )


def check_memory(r: Recipe, v: Fails) -> None:
    """memory: the limit, when given, is positive."""
    _positive(v, "memory.limit_gb", r.memory.limit_gb, allow_none=True)
    _positive(v, "memory.clear_cache_every", r.memory.clear_cache_every, allow_none=True)
    _positive(v, "memory.clear_cache_gb", r.memory.clear_cache_gb, allow_none=True)


def check_checkpoints(r: Recipe, v: Fails) -> None:
    """checkpoints: how often and how many."""
    _positive(v, "checkpoints.every", r.checkpoints.every, allow_none=True)
    _positive(v, "checkpoints.keep_last", r.checkpoints.keep_last)
    if r.checkpoints.load_best_at_end and not r.checkpoints.save_best:
        v.fail("checkpoints.load_best_at_end", "needs checkpoints.save_best: true")


def check_export(r: Recipe, v: Fails) -> None:
    """export: adapter formats need adapters; a quantization-aware run's GGUF needs a type
    that holds its codes."""
    for fmt in ("mlx-lm", "peft"):
        if fmt in r.export.formats and r.adapter.type == "full":
            v.fail("export.formats", f"{fmt} adapters need adapter.type lora or dora; use fused")
    q = r.train.qat
    if q is not None and "gguf" in r.export.formats:
        why = gguf_refusal({"bits": q.bits, "group_size": q.group_size, "mode": q.mode})
        if why is not None:
            v.fail(
                "export.formats", f"gguf of a run with train.qat ({q.mode}, {q.bits} bits): {why}"
            )


REPORTER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The module each reporter needs, from the extra of its name."""


def install_command(name: str) -> str:
    """How to install what reporter ``name`` needs."""
    return f"pip install 'mlxtune[{name}]'"


def reporter_missing(name: str) -> bool:
    """Whether the package a reporter needs is missing (checked without importing it)."""
    return importlib.util.find_spec(REPORTER_MODULES[name]) is None


def check_report(r: Recipe, v: Fails) -> None:
    """report: each reporter once, and installed."""
    if len(set(r.report)) != len(r.report):
        v.fail("report", f"names a reporter twice: {r.report}")
    for name in dict.fromkeys(r.report):
        if reporter_missing(name):
            v.fail("report", f"{name} is not installed: {install_command(name)}")
