"""Keys without effect: those a recipe sets (``recipe.explicit``) that its other settings make
meaningless. They are reported (``mlxtune validate``, and the log of a run), not refused."""

from __future__ import annotations

import dataclasses

from ..engine.precision import scaling_mode
from .rules import PREFERENCE
from .schema import Recipe


def inert_keys(recipe: Recipe) -> list[tuple[str, str]]:
    """(dotted key, why) for each key the recipe sets explicitly (``recipe.explicit``) that its
    other settings make meaningless: the run would be the same without it. A key left at its
    default is never listed."""
    r, found = recipe, []

    def inert(keys: tuple[str, ...], why: str) -> None:
        found.extend((k, why) for k in keys if k in r.explicit)

    _model_data_inert(r, inert)
    if r.adapter.type == "full":
        keys = ("rank", "alpha", "dropout", "targets", "layers", "rslora", "lora_plus_ratio")
        inert(tuple(f"adapter.{k}" for k in keys), "adapter.type is full")

    _optimizer_inert(r, inert)

    es = r.train.early_stopping
    if es.patience is None:
        inert(("train.early_stopping.min_delta",), "train.early_stopping.patience is null")
        if not r.checkpoints.save_best:
            keys = ("train.early_stopping.metric", "train.early_stopping.mode")
            inert(keys, "neither early stopping nor checkpoints.save_best uses them")

    if r.schedule.name == "constant":
        inert(("schedule.min_lr",), "schedule.name is constant")
    if r.schedule.name != "warmup_stable_decay":
        inert(("schedule.decay_fraction",), f"schedule.name is {r.schedule.name}")
    if r.train.max_steps is not None:
        inert(("train.epochs",), "train.max_steps is set")
        q = r.train.qat
        if q is not None and q.start_step >= r.train.max_steps:
            inert(
                ("train.qat.start_step",),
                f"the run ends at step {r.train.max_steps}, before QAT would start (its "
                "exports are then quantized after training)",
            )
    if r.eval.exact_match == 0:
        inert(("eval.max_new_tokens",), "eval.exact_match is 0")
    if r.samples.every is None:
        keys = tuple(f"samples.{k}" for k in ("prompts", "count", "max_new_tokens", "temperature"))
        inert(keys, "samples.every is null (no samples are drawn)")
    elif r.samples.prompts:
        inert(("samples.count",), "samples.prompts is given")

    _precision_inert(r, inert)
    _objective_inert(r, inert)
    return found


def _model_data_inert(r: Recipe, inert) -> None:
    """Model, tokenizer and data keys the other settings leave unread."""
    if r.model.arch is None:
        inert(("model.seed",), "the model is loaded from model.path (it seeds model.arch only)")
    elif r.tokenizer.train is not None:
        inert(
            ("model.trust_remote_code",),
            "the model is built from model.arch and the tokenizer trained: no code is loaded",
        )
    if r.tokenizer.train is not None:
        inert(("tokenizer.path",), "tokenizer.train trains a new tokenizer")
    if not str(r.model.path or "").endswith(".gguf"):
        inert(("model.dequantize",), "it applies to a GGUF base (model.path: *.gguf)")
    elif r.adapter.type == "full":
        inert(("model.dequantize",), "a full fine-tune de-quantizes every weight to train it")

    d = r.data
    if d.valid is not None:
        inert(("data.valid_fraction", "data.valid_size"), "data.valid is given")
    if d.test is not None:
        inert(("data.test_size",), "data.test is given")
    if d.valid is not None and (d.test is not None or d.test_size is None):
        inert(("data.split_seed",), "nothing is held out of the training data")
    elif d.streaming:
        inert(("data.split_seed",), "a stream holds out its first rows, not drawn ones")
    if not d.streaming:
        inert(("data.stream_window",), "data.streaming is false")
    if d.packing != "off":
        # pad_to_multiple still shapes the evaluation batches, which are never packed
        inert(("data.bucket_size",), f"data.packing is {d.packing}")
    else:
        inert(("data.mask_boundary_loss",), "data.packing is off")
    if d.packing == "stream" and d.valid is None and d.test is None:
        # the stream cuts training documents into rows, and the held-out split is cut at
        # max_length whatever overlong says; only a valid or test file reads it
        inert(("data.overlong",), "data.packing is stream and no data.valid or data.test is given")
    if not d.add_eos:
        inert(("data.train_on_eos",), "data.add_eos is false")
    if d.bad_rows == "error":
        inert(("data.max_bad_fraction",), "data.bad_rows is error")
    if d.format not in ("auto", "chat", "sharegpt", "preference", "completion"):
        inert(
            ("data.chat_template_kwargs", "data.train_on_reasoning"),
            f"data.format is {d.format}: no chat template renders it",
        )


def _optimizer_inert(r: Recipe, inert) -> None:
    """Optimizer keys (and the other optimizers' blocks) the chosen optimizer does not read."""
    o = r.optimizer
    if o.name in ("sgd", "lion", "adafactor", "sophia"):
        keys = ("eps", "bias_correction") + (("betas",) if o.name != "lion" else ())
        inert(tuple(f"optimizer.{k}" for k in keys), f"optimizer.name is {o.name}")
    if o.name != "sgd":
        inert(("optimizer.momentum",), f"optimizer.name is {o.name}")
    if o.name == "adam":
        inert(("optimizer.weight_decay",), "optimizer.name is adam (adamw decays weights)")
    for name, block in (("adafactor", o.adafactor), ("muon", o.muon), ("sophia", o.sophia)):
        if o.name != name:
            keys = tuple(f"optimizer.{name}.{f.name}" for f in dataclasses.fields(block))
            inert(keys, f"optimizer.name is {o.name}")
    if o.name == "muon" and r.adapter.type == "full":
        inert(("optimizer.muon.adapters",), "adapter.type is full (no adapters train)")


def _precision_inert(r: Recipe, inert) -> None:
    """Loss-scaling, master-weight, skip and memory keys the precision settings leave unread."""
    p = r.precision
    mode = scaling_mode(p, r.model.dtype)
    if mode != "dynamic":
        why = (
            f"loss scaling is {mode} (precision.loss_scale auto with model.dtype {r.model.dtype})"
            if p.loss_scale == "auto"
            else f"precision.loss_scale is {p.loss_scale}"
        )
        keys = ("growth_factor", "backoff_factor", "growth_interval", "min_scale")
        if mode == "none":
            keys = ("init_scale", *keys)
        inert(tuple(f"precision.{k}" for k in keys), why)
    if r.model.dtype == "float32":
        inert(("precision.master_weights",), "model.dtype is float32 (the weights are fp32)")
    if p.nonfinite == "stop":
        inert(("precision.max_skipped",), "precision.nonfinite is stop")
    if r.memory.check == "off":
        inert(("memory.limit_gb",), "memory.check is off")


def _objective_inert(r: Recipe, inert) -> None:
    """Data, training and objective keys the objective does not read (preference pairs, reward
    models, GRPO)."""
    kind = r.objective.type
    if kind != "sft":
        inert(("train.neftune_noise_alpha",), f"NEFTune is for SFT, not objective.type {kind}")
    if kind in PREFERENCE:
        inert(("data.mask_prompt",), f"objective.type {kind} scores the completions only")
        inert(("train.label_smoothing",), f"objective.type {kind} does not read it")
        if r.data.packing != "off":
            inert(("data.mask_boundary_loss",), "a pair's sequences never score their first token")
    if kind == "cpo" and r.objective.loss != "simpo":
        inert(("objective.simpo_gamma",), f"objective.loss is {r.objective.loss}, not simpo")
    if kind == "grpo" and r.objective.loss != "sapo":
        keys = ("objective.sapo_temperature_pos", "objective.sapo_temperature_neg")
        inert(keys, f"objective.loss is {r.objective.loss}, not sapo")
    if kind == "grpo" and not (r.objective.tools or r.objective.environment):
        keys = ("max_turns", "max_rollout_length", "tool_timeout_s", "tool_format")
        why = "neither objective.tools nor objective.environment is set (single-turn rollouts)"
        inert(tuple(f"objective.{k}" for k in keys), why)
    if kind == "grpo" and r.objective.importance_sampling_correction == "none":
        why = "objective.importance_sampling_correction is none"
        inert(("objective.importance_sampling_cap",), why)
    if kind == "grpo" and not r.objective.filter_groups:
        inert(("objective.filter_max_draws",), "objective.filter_groups is off")
    if kind == "grpo" and r.objective.environment and not r.objective.tools:
        why = "objective.tools is not set (the environment answers every turn)"
        inert(("objective.tool_timeout_s", "objective.tool_format"), why)
    if kind == "reward":
        why = "a reward model scores each sequence's last token, with no LM head or loss kernel"
        inert(("data.train_on_eos", "kernels.loss"), why)
    if kind == "distill":
        _distill_inert(r, inert)
    if kind in ("grpo", "ppo", "online_dpo"):
        why = f"objective.type {kind} trains on completions"
        inert(
            ("data.mask_prompt", "data.train_on_eos", "data.train_on_reasoning"),
            f"{why} (EOS included), never prompts",
        )
        inert(("train.label_smoothing",), f"{why} weighted by their advantages")
        drawn = f"objective.type {kind} batches prompts as drawn"
        inert(("data.bucket_size", "data.min_length"), drawn)
        o = r.objective
        weight = "kl_coef" if kind == "ppo" else "beta"
        if getattr(o, weight) == 0:
            inert(("objective.reference",), f"objective.{weight} is 0 (no KL term)")
        if kind == "ppo" and o.kl_target is None:
            inert(("objective.kl_horizon",), "objective.kl_target is not set (a fixed kl_coef)")


DISTILL_KEYS = {
    "offline": ("teacher_logits", "top_k", "alpha", "temperature"),
    "gkd": (
        "temperature",
        "beta",
        "lmbda",
        "seq_kd",
        "max_completion_length",
        "generation_temperature",
    ),  # fmt: skip
    "on_policy": ("max_completion_length", "generation_temperature"),
}
"""The keys of ``objective.type: distill`` each mode reads, beside the teacher's."""


def _distill_inert(r: Recipe, inert) -> None:
    o = r.objective
    every = {k for keys in DISTILL_KEYS.values() for k in keys}
    unread = sorted(every - set(DISTILL_KEYS[o.mode]))
    inert(tuple(f"objective.{k}" for k in unread), f"objective.mode is {o.mode}")
    inert(("train.label_smoothing",), "distillation matches the teacher's distributions")
    if o.mode != "offline":
        inert(("data.mask_prompt",), f"mode {o.mode} trains on completions only")


def inert_notes(recipe: Recipe) -> list[str]:
    """``inert_keys`` as the one-line notes ``mlxtune validate`` prints."""
    return [f"note: {key} has no effect: {why}" for key, why in inert_keys(recipe)]
