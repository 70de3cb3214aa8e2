"""The trainer: one loop, readable top to bottom (``Trainer.run``); the pieces it calls live in
small modules of their own."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from . import _blas
from .adapters import apply_adapters
from .console import Console
from .control import take_requests
from .data import (
    Dataset,
    Encoder,
    eval_batches,
    iterate_batches,
    iterate_packed,
    load_split,
    packed_epoch,
    read_jsonl,
    split_batch,
    split_off,
)
from .errors import Interrupted, TrainingError, UserInputError
from .export import TrainedModel, export, import_adapter, load_trainable_weights, write_mlx_lm
from .generate import eos_ids, exact_match, generate_ids
from .kernels import linear_cross_entropy
from .memory import GB, alternatives, describe, device_budget, estimate, is_out_of_memory, shape_of
from .models import (
    build_model,
    checkpoint_layers,
    count_parameters,
    kernel_attention,
    lm_parts,
    load_model,
    quantize_model,
    resolve_model_path,
    segments,
)
from .optim import build_optimizer, make_schedule
from .precision import (
    all_finite,
    make_masters,
    scaling_mode,
    select_into,
    snapshot,
    update_scale,
)
from .recipe import Recipe, dump_yaml
from .resume import named as named_checkpoint
from .resume import pick as pick_checkpoint
from .resume import recipe_changes, write_checksums
from .rundir import RunDir, holds_a_run, removed_if_refused, run_dir_for
from .tokenizer import load_tokenizer, train_sentencepiece

IGNORE = -100


@dataclass(eq=False)
class _Step:
    """One optimizer step as the loop queued it: what the host knows, the device's results
    (lazy until read), and, once read, their values."""

    step: int
    n: int  # target tokens (known on the host)
    loss_sum: mx.array
    norm: mx.array
    ok: mx.array
    scale: mx.array  # the loss scale the step multiplied by
    lr: mx.array  # the learning rate it used
    read: bool = False
    loss: float = math.nan
    grad_norm: float = math.nan
    lr_value: float = math.nan
    applied: bool = True
    tokens_seen: int = 0


class StepEvent:
    """What a callback sees after every optimizer step.

    Steps are queued ahead of the device, so the step may still be running when ``on_step`` is
    called. ``step``, ``epoch`` and ``step_time_s`` (the host's seconds since the previous step)
    are plain numbers; reading ``loss``, ``lr``, ``grad_norm`` or ``tokens_seen`` waits for the
    step to finish (a callback that reads them every step makes every step wait)."""

    def __init__(self, step: int, epoch: float, step_time_s: float, record: _Step, read):
        self.step, self.epoch, self.step_time_s = step, epoch, step_time_s
        self._record, self._read = record, read

    def _value(self, name: str):
        if not self._record.read:
            self._read()
        if not self._record.read:  # only when the run ended with this step still queued
            raise RuntimeError(f"step {self.step}'s results were never read: the run ended first")
        return getattr(self._record, name)

    @property
    def loss(self) -> float:
        """Mean loss over the step's target tokens."""
        return self._value("loss")

    @property
    def lr(self) -> float:
        return self._value("lr_value")

    @property
    def grad_norm(self) -> float:
        """Before clipping; not finite for a step whose update was skipped."""
        return self._value("grad_norm")

    @property
    def tokens_seen(self) -> int:
        """Target tokens trained on so far, this step included (skipped steps' not counted)."""
        return self._value("tokens_seen")

    def __repr__(self) -> str:
        return f"StepEvent(step={self.step}, epoch={self.epoch:.4f})"


@dataclass(eq=False)
class _Loop:
    """The loop's running totals, shared by Trainer._run and Trainer._read_steps."""

    tokens_seen: int
    window: dict
    mark: float  # when the time being counted began
    first_step_time: float | None = None
    timed_s: float = 0.0
    timed_steps: int = 0


class Callback:
    """Hooks into a run. Override what you need; ``trainer.request_stop()`` and
    ``trainer.request_save()`` steer the run from any hook."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step(self, trainer: Trainer, event: StepEvent) -> None: ...

    def on_eval(self, trainer: Trainer, metrics: dict) -> None: ...

    def on_train_end(self, trainer: Trainer, summary: dict) -> None: ...


class _FunctionCallback(Callback):
    def __init__(self, fn):
        self.fn = fn

    def on_step(self, trainer, event):
        self.fn(trainer, event)


def _texts_for_tokenizer(rows: list[tuple[int, dict]]) -> list[str]:
    out = []
    for _, obj in rows:
        for key in ("text", "prompt", "completion", "instruction", "input", "output"):
            if isinstance(obj.get(key), str):
                out.append(obj[key])
        for m in obj.get("messages") or []:
            if isinstance(m, dict) and isinstance(m.get("content"), str):
                out.append(m["content"])
    return out


class Trainer:
    """Builds everything a recipe names, then trains it with ``run()``.

    >>> trainer = Trainer(load_recipe("recipes/quickstart.yaml"), run_dir="runs/demo")
    >>> summary = trainer.run()
    """

    def __init__(
        self,
        recipe: Recipe,
        run_dir: str | Path | None = None,
        callbacks=(),
        console: Console | None = None,
        dry_run: bool = False,
        resume: str | None = None,
    ):
        """``resume``: continue the run in ``run_dir`` from "latest" (its newest intact
        checkpoint) or from a named checkpoint, exactly where it stopped."""
        self.recipe = recipe
        self.dry_run = dry_run
        self.resume_from = resume
        self._resumed: dict | None = None
        self.callbacks = [c if isinstance(c, Callback) else _FunctionCallback(c) for c in callbacks]
        self.console = console or Console(quiet=False, progress=recipe.train.progress)
        self._stop = False
        self._save = False
        self._tmp = None
        if dry_run:
            self._tmp = tempfile.TemporaryDirectory(prefix="mlxtune-dry-")
            self.run_dir = RunDir(self._tmp.name, create=True)
        elif resume is not None:
            path = Path(run_dir or recipe.run_dir or "")
            if not run_dir and not recipe.run_dir:
                raise UserInputError("--resume needs the run's directory (--run-dir)", "--resume")
            if not holds_a_run(path):
                raise UserInputError("no run to resume here", str(path))
            if resume != "latest":
                named_checkpoint(path, resume)  # before anything is loaded or logged
            self.run_dir = RunDir(path, create=False)
        else:
            path = run_dir_for(recipe, run_dir)
            with removed_if_refused(path):  # refused input leaves no run folder behind
                self.run_dir = RunDir(path)
                self._set_up()
            return
        self._set_up()

    def _set_up(self):
        """Build everything; log lines reach log.txt only once the input has been accepted (a
        refused --resume leaves the run's log as it was)."""
        self._held_logs: list[str] | None = []
        self.blas = _blas.setup_blas()
        self._setup()
        held, self._held_logs = self._held_logs, None
        for line in held:
            self.run_dir.log(line)

    # ---------------------------------------------------------------- steering
    def _take_control(self) -> set[str]:
        """Requests from RUN_DIR/control/ (the dashboard's keys); pause waits here for resume."""
        asked = take_requests(self.run_dir.path)
        if "pause" in asked and "resume" not in asked and "stop" not in asked:
            self._read_steps()  # the steps before the pause are timed without it
            self.log("paused (control/resume to go on)")
            self.console.end_progress()
            while not ({"resume", "stop"} & asked):
                time.sleep(0.2)
                asked |= take_requests(self.run_dir.path)
            self.log("resumed" if "resume" in asked else "stop requested while paused")
            self._loop.mark = time.perf_counter()
        if "save" in asked:
            self._save = True
        if "stop" in asked:
            self._stop = True
        return asked

    def request_stop(self):
        """Finish the current step, save, export as the recipe says, and return."""
        self._stop = True

    def request_save(self):
        """Save a checkpoint after the current step."""
        self._save = True

    # ---------------------------------------------------------------- setup
    def _check_kernels(self):
        """Resolve each kernel choice to the tier it runs as here (``self.tiers``), refusing one
        this machine cannot run, before anything is loaded or compiled."""
        from .kernels import gpu_backend, on_gpu, resolve, self_check

        k = self.recipe.kernels
        self.tiers = {}
        for name, choice in (("loss", k.loss), ("attention", k.attention)):
            if choice == "off":
                self.tiers[name] = "off"
                continue
            try:
                self.tiers[name] = resolve(choice)
            except ValueError as e:
                raise UserInputError(str(e), f"kernels.{name}") from None
        # A GPU tier runs only once it has passed its check against the reference on this
        # machine: "auto" falls back to chunked, a recipe or MLXTUNE_KERNELS naming it is refused.
        # Checked only where the GPU tier could run.
        gpu, env = gpu_backend(), os.environ.get("MLXTUNE_KERNELS")
        chosen = (k.loss, k.attention)
        if gpu is None or not on_gpu():
            return
        if not (gpu in self.tiers.values() or ("auto" in chosen and not env)):
            return
        why = self_check(gpu)
        for name, tier in self.tiers.items():
            if why is not None and tier == gpu:
                raise UserInputError(
                    f"the {gpu} kernels failed their check here: {why}", f"kernels.{name}"
                )
        self.log(
            f"kernels: the {gpu} tier agrees with the reference here"
            if why is None
            else f"kernels: not using the {gpu} tier ({why}); running the chunked tier"
        )

    def _setup(self):
        r = self.recipe
        self.log(f"BLAS: {self.blas.note}")
        self._check_kernels()
        train_path = r.resolve_path(r.data.train)
        train_rows = read_jsonl(train_path)

        # Tokenizer
        model_dir = (
            resolve_model_path(r.model.path, Path(r.source).parent if r.source else None)
            if r.model.path
            else None
        )
        self.model_dir = model_dir
        if r.tokenizer.train is not None and self.resume_from is not None:
            self.tokenizer_dir = self.run_dir.inside("tokenizer")  # the one this run trained
            self.tokenizer = load_tokenizer(self.tokenizer_dir)
        elif r.tokenizer.train is not None:
            t = r.tokenizer.train
            self.tokenizer_dir = self.run_dir.inside("tokenizer")
            self.log(
                f"training a {t.model_type} sentencepiece tokenizer (vocab {t.vocab_size}) on {train_path}"
            )
            self.tokenizer = train_sentencepiece(
                _texts_for_tokenizer(train_rows),
                self.tokenizer_dir,
                t.vocab_size,
                t.model_type,
                t.character_coverage,
                t.max_sentences,
                r.train.seed,
            )
        else:
            self.tokenizer_dir = r.resolve_path(r.tokenizer.path) if r.tokenizer.path else model_dir
            if self.tokenizer_dir is None:
                raise UserInputError(
                    "no tokenizer: set tokenizer.path or tokenizer.train", "tokenizer"
                )
            self.tokenizer = load_tokenizer(
                self.tokenizer_dir, trust_remote_code=r.model.trust_remote_code
            )
        if r.tokenizer.chat_template is not None:
            self.tokenizer._tokenizer.chat_template = r.tokenizer.chat_template
        vocab = len(self.tokenizer._tokenizer)

        # Model
        if r.model.arch is not None:
            special = {
                "bos_token_id": self.tokenizer.bos_token_id,
                "eos_token_id": self.tokenizer.eos_token_id,
            }
            self.model, self.model_config = build_model(
                r.model.arch, vocab, r.model.dtype, r.model.seed, special
            )
            self.log(f"built a new {self.model_config['model_type']} model from model.arch")
        else:
            self.model, self.model_config = load_model(
                model_dir, r.model.dtype, r.model.trust_remote_code
            )
            self.log(f"loaded {model_dir}")
            if r.model.quantize is not None:
                self._quantize_base(r.model.quantize)
        model_vocab = self.model_config.get("vocab_size") or vocab
        if vocab > model_vocab:
            raise UserInputError(
                f"the tokenizer ({self.tokenizer_dir}) has {vocab} tokens but the model's "
                f"vocabulary ({model_dir or 'model.arch'}) is {model_vocab}",
                "tokenizer",
            )
        self.parts = lm_parts(self.model)

        # Adapters
        mx.random.seed(r.train.seed)
        a = r.adapter
        self.adapter_info = apply_adapters(
            self.model, a.type, a.rank, a.alpha, a.dropout, a.targets, a.layers
        )
        if a.init_from is not None:
            import_adapter(self.model, r.resolve_path(a.init_from))
            self.log(f"adapter weights from {a.init_from}")
        if r.train.grad_checkpointing:
            n = checkpoint_layers(self.model, int(r.train.grad_checkpointing))
            self.log(
                f"gradient checkpointing: {n} of {len(self.model.layers)} layers recompute "
                "their activations in the backward pass"
            )
        self.trainable, self.total_params = count_parameters(self.model)
        trainable_names = {k for k, _ in tree_flatten(self.model.trainable_parameters())}
        self._head_trains = bool({"lm_head.weight", "model.embed_tokens.weight"} & trainable_names)

        # Data
        d = r.data
        enc = Encoder(self.tokenizer, d.mask_prompt, d.add_eos, d.train_on_eos)
        # a token stream is cut into rows, not truncated per document
        train_max = 1 << 62 if d.packing == "stream" else d.max_length
        self.train_set = load_split(train_path, enc, d.format, train_max, d.overlong, d.min_length)
        if d.valid:
            self.valid_set = load_split(
                r.resolve_path(d.valid), enc, d.format, d.max_length, d.overlong, d.min_length
            )
        else:
            self.train_set, self.valid_set = split_off(
                self.train_set, d.valid_fraction, r.train.seed
            )
            if d.packing == "stream":  # evaluation reads one document a row, up to max_length
                for e in self.valid_set.examples:
                    e.ids, e.mask = e.ids[: d.max_length], e.mask[: d.max_length]
        self.test_set = (
            load_split(
                r.resolve_path(d.test), enc, d.format, d.max_length, d.overlong, d.min_length
            )
            if d.test
            else self.valid_set
        )
        if r.eval.exact_match and not any(e.prompt_ids for e in self.test_set.examples):
            raise UserInputError(
                "eval.exact_match needs completion, instruction or chat data", "eval.exact_match"
            )
        self.pad_id = next(
            i
            for i in (self.tokenizer._tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
            if i is not None
        )

        # Steps and schedule
        t = r.train
        self.packing = d.packing
        self.pack_length = d.pack_length or d.max_length
        if self.packing != "off":
            if not kernel_attention(self.model).active:
                raise UserInputError(
                    f"packed rows need the model's attention routed through mlxtune's kernels, "
                    f"which {self.model_config.get('model_type')} does not allow; use packing: off",
                    "data.packing",
                )
            rows = packed_epoch(self.train_set, self.packing, self.pack_length, t.seed, 0)
            self.batches_per_epoch = math.ceil(len(rows) / t.batch_size)
        else:
            self.batches_per_epoch = math.ceil(len(self.train_set) / t.batch_size)
        if t.max_steps is not None:
            self.total_steps = t.max_steps
        else:
            self.total_steps = max(
                1, math.ceil(t.epochs * self.batches_per_epoch / t.grad_accumulation)
            )
        s = r.schedule
        self.schedule = make_schedule(
            s.name, r.optimizer.lr, self.total_steps, s.warmup_steps, s.min_lr
        )
        self.optimizer = build_optimizer(r.optimizer, self.schedule)
        self._dtypes = tree_map(lambda w: w.dtype, self.model.trainable_parameters())
        self._masters = [
            make_masters(self.model.trainable_parameters(), r.precision.master_weights)
        ]
        self.scaling = scaling_mode(r.precision, r.model.dtype)
        self.scaler = {
            "scale": mx.array(r.precision.init_scale if self.scaling != "none" else 1.0),
            "good": mx.array(0, dtype=mx.int32),
        }
        self._nf = {"skipped": 0, "in_a_row": 0}
        self._split = 1  # micro-batches per batch (more after running out of memory)
        if self.resume_from is not None and not self.dry_run:
            self._load_resume(self.resume_from)
        self._build_steps()
        self._plan_memory()
        self._write_resolved()

    def _plan_memory(self):
        """Estimate the peak memory; over the budget, refuse (or warn) naming what would fit."""
        m = self.recipe.memory
        shape = shape_of(self)
        est = estimate(shape)
        if m.limit_gb is not None:
            budget, what = m.limit_gb * GB, "memory.limit_gb"
        else:
            budget, what = device_budget()
        self.memory_estimate = est
        self.log(
            f"memory: estimated peak {describe(est)}; the budget is {budget / GB:.2f} GB ({what})"
        )
        if est["total"] <= budget or m.check == "off":
            return
        fits = alternatives(shape, budget, self.recipe)
        msg = (
            f"this run needs about {est['total'] / GB:.2f} GB at its peak, more than the "
            f"{budget / GB:.2f} GB of {what}; "
            + (
                "any of these would fit: " + "; ".join(fits)
                if fits
                else "no single change fits: combine a smaller train.batch_size, a shorter "
                "data.max_length, adapter.type: lora and model.dtype: bfloat16"
            )
            + " (memory.check: warn runs it anyway)"
        )
        if m.check == "warn":
            self.log(f"WARNING: {msg}")
            return
        raise UserInputError(msg, self.recipe.source or "recipe")

    def _quantize_base(self, cfg):
        """QLoRA: quantize the loaded base before the adapters go in."""
        q = quantize_model(self.model, cfg.bits, cfg.group_size)
        if not q["layers"] and not q["already"]:
            raise UserInputError(
                f"no layer's input size is a multiple of {q['group_size']}; use a smaller "
                "group_size",
                "model.quantize.group_size",
            )
        self.log(
            f"quantized the base to {q['bits']} bits in groups of {q['group_size']}: "
            f"{q['layers']} layers, weights {q['bytes_before'] / GB:.3f} -> "
            f"{q['bytes_after'] / GB:.3f} GB"
            + (f"; {len(q['skipped'])} stay dense (input size)" if q["skipped"] else "")
        )

    def derived(self) -> dict:
        t = self.recipe.train
        rows = (
            self.batches_per_epoch * t.batch_size if self.packing != "off" else len(self.train_set)
        )
        mean_targets = self.train_set.stats.target_tokens / max(rows, 1)  # per row
        return {
            "effective_steps": self.total_steps,
            "epochs": round(self.total_steps * t.grad_accumulation / self.batches_per_epoch, 4),
            "batches_per_epoch": self.batches_per_epoch,
            "examples_per_step": t.batch_size * t.grad_accumulation,
            "tokens_per_step": round(mean_targets * t.batch_size * t.grad_accumulation, 1),
            "trainable_parameters": self.trainable,
            "total_parameters": self.total_params,
            "trainable_percent": round(100 * self.trainable / max(self.total_params, 1), 4),
            "train_examples": len(self.train_set),
            "valid_examples": len(self.valid_set),
            "train_data": self.train_set.stats.line(),
            "valid_data": self.valid_set.stats.line(),
            "vocab_size": len(self.tokenizer._tokenizer),
            "adapted_modules": len(self.adapter_info["adapted"]),
            "estimated_peak_memory_gb": round(self.memory_estimate["total"] / GB, 3),
            "blas": self.blas.name,
            "device": str(mx.default_device()),
        }

    def _write_resolved(self):
        rd = self.run_dir
        rd.write_text("recipe.yaml", dump_yaml(self.recipe.to_dict()))
        rd.write_json(
            "config_resolved.json",
            {
                "recipe": self.recipe.to_dict(),
                "recipe_file": self.recipe.source,
                "model_dir": str(self.model_dir) if self.model_dir else None,
                "model_config": self.model_config,
                "derived": self.derived(),
            },
        )

    # ---------------------------------------------------------------- the compiled step
    def _loss(self, model, tokens, mask, segment_ids=None):
        """Summed cross-entropy over target tokens, and their count. Packed rows pass
        ``segment_ids`` so that attention stays within each example."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        targets = mx.where(mask[:, 1:] > 0, targets, IGNORE)
        with segments(None if segment_ids is None else segment_ids[:, :-1]):
            h = self.parts.hidden(inputs)
        return linear_cross_entropy(
            h.reshape(-1, h.shape[-1]),
            self.parts.head_weight(),
            targets.reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=self.recipe.train.label_smoothing,
            softcap=self.parts.softcap,
            impl=self.tiers["loss"],
            weight_grad=self._head_trains,
        )

    def _opt_params(self) -> dict:
        """What the optimizer updates: the fp32 masters, or the trainable weights themselves."""
        box = self._masters
        return box[0] if box[0] is not None else self.model.trainable_parameters()

    def _build_steps(self):
        model, opt = self.model, self.optimizer
        clip = self.recipe.optimizer.grad_clip
        p = self.recipe.precision
        dynamic = self.scaling == "dynamic"
        dtypes = self._dtypes
        scaler, box = self.scaler, self._masters
        opt.init(self._opt_params())  # before compiling: the state's structure is then fixed

        def scaled_loss(model, tokens, mask, factor, *segment_ids):
            loss, n = self._loss(model, tokens, mask, *segment_ids)
            return loss * factor, loss, n

        grad_fn = nn.value_and_grad(model, scaled_loss)
        state = [model.state, opt.state, mx.random.state, scaler]
        if box[0] is not None:
            state.append(box)

        def apply(grads, loss_sum):
            # the gradients are d(loss sum)/d(weights) x scale / tokens: unscale them in fp32
            inv = 1.0 / scaler["scale"]
            grads = tree_map(lambda g: g.astype(mx.float32) * inv, grads)
            sq = sum(mx.sum(mx.square(g)) for _, g in tree_flatten(grads))
            ok = all_finite(loss_sum, sq)
            norm = mx.sqrt(sq)
            if clip is not None:
                shrink = mx.minimum(clip / (norm + 1e-6), 1.0)
                grads = tree_map(lambda g: g * shrink, grads)
            params = self._opt_params()
            grads = tree_map(lambda g, w: g.astype(w.dtype), grads, params)
            before = snapshot(opt.state)
            new = opt.apply_gradients(grads, params)
            # a non-finite step changes nothing: weights, masters and optimizer state stay
            new = tree_map(lambda a, b: mx.where(ok, a, b), new, params)
            select_into(opt.state, before, ok)
            if box[0] is not None:
                box[0] = new
                model.update(tree_map(lambda w, dt: w.astype(dt), new, dtypes))
            else:
                model.update(new)
            if dynamic:
                update_scale(
                    scaler, ok, p.growth_factor, p.backoff_factor, p.growth_interval, p.min_scale
                )
            return norm, ok

        @partial(mx.compile, inputs=state, outputs=state)
        def train_step(tokens, mask, inv_tokens, *seg):
            (_, loss, n), grads = grad_fn(model, tokens, mask, scaler["scale"] * inv_tokens, *seg)
            return (loss, n, *apply(grads, loss))

        @partial(mx.compile, inputs=state, outputs=state)
        def grad_step(tokens, mask, inv_tokens, *seg):
            (_, loss, n), grads = grad_fn(model, tokens, mask, scaler["scale"] * inv_tokens, *seg)
            return loss, n, tree_map(lambda g: g.astype(mx.float32), grads)

        @partial(mx.compile, inputs=state, outputs=state)
        def apply_step(grads, loss_sum):
            return apply(grads, loss_sum)

        @partial(mx.compile, inputs=[model.state])
        def eval_step(tokens, mask):
            return self._loss(model, tokens, mask)

        self._train_step, self._grad_step, self._apply_step, self._eval_step = (
            train_step,
            grad_step,
            apply_step,
            eval_step,
        )
        self._state = state

    def _optimizer_step(self, micro_batches):
        """One optimizer step over grad_accumulation micro-batches: (loss sum, tokens, grad norm,
        finite), queued on the device without waiting for it. A step that is not finite leaves
        every weight and optimizer state as it was."""
        n_total = sum(b.n_targets for b in micro_batches)
        inv = mx.array(1.0 / max(n_total, 1), dtype=mx.float32)

        def seg(b):
            return () if b.segments is None else (mx.array(b.segments),)

        if len(micro_batches) == 1:
            b = micro_batches[0]
            loss, n, norm, ok = self._train_step(mx.array(b.tokens), mx.array(b.mask), inv, *seg(b))
            mx.async_eval(self._state, loss, n, norm, ok)
            return loss, n, norm, ok
        acc = loss_sum = n_sum = None
        for b in micro_batches:
            loss, n, grads = self._grad_step(mx.array(b.tokens), mx.array(b.mask), inv, *seg(b))
            acc = grads if acc is None else tree_map(mx.add, acc, grads)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            n_sum = n if n_sum is None else n_sum + n
            mx.async_eval(acc, loss_sum, n_sum)
        norm, ok = self._apply_step(acc, loss_sum)
        mx.async_eval(self._state, norm, ok)
        return loss_sum, n_sum, norm, ok

    def _step_or_fall_back(self, micro, step: int):
        """``_optimizer_step`` over the step's batches, each split into ``self._split`` micro-batches;
        out of memory, the split doubles (the same examples per step) and the step is retried."""
        while True:
            parts = [p for b in micro for p in split_batch(b, self._split)]
            fallback = self.recipe.memory.oom_fallback
            saved = snapshot(self._state) if fallback else None
            try:
                return self._optimizer_step(parts)
            except Exception as e:
                if saved is None or not is_out_of_memory(e):
                    raise
                select_into(self._state, saved)  # the failed step left nothing behind
                del parts
                mx.clear_cache()
                rows = max(len(b.tokens) for b in micro)
                t = self.recipe.train
                if self._split >= rows:
                    raise TrainingError(
                        f"step {step}: out of memory even with micro-batches of one example "
                        f"({e}); use a shorter data.max_length, adapter.type: lora, or "
                        "model.dtype: bfloat16"
                    ) from None
                self._split *= 2
                size = math.ceil(rows / self._split)
                self.log(
                    f"WARNING: step {step}: out of memory ({e}); going on with micro-batches of "
                    f"{size} and grad_accumulation {t.grad_accumulation * self._split} (the same "
                    f"{t.batch_size * t.grad_accumulation} examples per step)"
                )

    def _read_steps(self):
        """Wait for the queued steps (one wait for all of them) and account for each in order:
        its loss and gradient norm, whether its update was applied, the tokens trained on, the
        loss scaler's and the non-finite policy's verdicts, and the time they took."""
        queued, loop = self._queued, self._loop
        if not queued:
            return
        mx.eval([(q.loss_sum, q.norm, q.ok, q.scale, q.lr) for q in queued])
        now = time.perf_counter()
        elapsed, loop.mark = now - loop.mark, now
        self._queued = []
        for q in queued:
            q.grad_norm, q.lr_value, q.applied = q.norm.item(), q.lr.item(), q.ok.item()
        w = loop.window
        if loop.first_step_time is None:  # the first step (compilation included) is read alone
            loop.first_step_time = elapsed
        else:
            w["timed_n"] += sum(q.n for q in queued if q.applied)
            w["time"] += elapsed
            w["steps"] += len(queued)
            loop.timed_s += elapsed
            loop.timed_steps += len(queued)
        after = [q.scale for q in queued[1:]] + [self.scaler["scale"]]
        stop = None  # the first non-finite step that ends the run; raised once all are read
        for q, scale_after in zip(queued, after, strict=True):
            loss_sum = q.loss_sum.item()
            q.loss = loss_sum / max(q.n, 1)
            if q.applied:
                self._nf["in_a_row"] = 0
                loop.tokens_seen += q.n  # tokens trained on: a skipped step's do not count
                w["loss"] += loss_sum
                w["n"] += q.n
                self.last_loss = q.loss
            q.tokens_seen = loop.tokens_seen
            q.read = True
            if not q.applied and stop is None:
                try:
                    self._nonfinite(q.step, q.loss, q.grad_norm, q.scale.item(), scale_after.item())
                except TrainingError as e:
                    stop = e
        if stop is not None:
            raise stop

    def _nonfinite(
        self, step: int, loss: float, norm: float, scale_used: float, scale_after: float
    ):
        """A step whose loss or gradients were not finite (its update was not applied): an
        overflow the loss scaler handles, a skip, or the end of the run."""
        p = self.recipe.precision
        nf = self._nf
        nf["skipped"] += 1
        what = (
            f"the loss became {loss}"
            if not math.isfinite(loss)
            else f"the gradients became non-finite (loss {loss:.4g})"
        )
        if self.scaling == "dynamic" and scale_used > p.min_scale:
            self.run_dir.log(
                f"step {step}: gradients overflowed at loss scale {scale_used:g}; "
                f"update skipped, scale now {scale_after:g}"
            )
            return
        nf["in_a_row"] += 1
        if p.nonfinite == "skip" and nf["in_a_row"] <= p.max_skipped:
            self.log(
                f"WARNING: step {step}: {what}; update skipped "
                f"({nf['in_a_row']} in a row, at most {p.max_skipped})"
            )
            return
        steps = (
            sorted(c.name for c in self.run_dir.checkpoints.glob("step-*") if c.is_dir())
            if self.run_dir.checkpoints.exists()
            else []
        )
        last = f"checkpoints/{steps[-1]}" if steps else "none saved yet"
        in_a_row = f" ({nf['in_a_row']} steps in a row)" if nf["in_a_row"] > 1 else ""
        raise TrainingError(
            f"step {step}: {what}{in_a_row}; the update was not applied and the run stops. "
            f"Last checkpoint: {last}. Try a lower optimizer.lr, optimizer.grad_clip, "
            "model.dtype: float32, or check the data; resuming with "
            "precision.nonfinite=skip steps over such batches"
        )

    # ---------------------------------------------------------------- the loop
    def run(self) -> dict:
        """Train as the recipe says; returns the summary (also printed and logged).

        On SIGINT or SIGTERM (in the main thread) the current step finishes, a checkpoint is
        saved and ``Interrupted`` is raised, saying how to resume; a second signal stops at once.
        """
        restore = self._catch_signals()
        try:
            if self.tiers["attention"] == "off":
                return self._run()
            with kernel_attention(self.model, self.tiers["attention"]):
                return self._run()
        finally:
            restore()

    def _catch_signals(self):
        self._interrupted = None
        if threading.current_thread() is not threading.main_thread() or self.dry_run:
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            if self._interrupted is not None:  # the second one: stop now
                for s, h in previous.items():
                    signal.signal(s, h)
                raise KeyboardInterrupt
            self._interrupted = signal.Signals(signum).name
            self.console.info(
                f"{self._interrupted}: finishing this step, then saving a checkpoint "
                "(again to stop at once)"
            )

        for s in previous:
            signal.signal(s, handler)

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)

        return restore

    def batches(self, start_epoch: int = 0, skip: int = 0):
        """The endless (epoch, Batch) stream the run trains on, from batch ``skip`` of epoch
        ``start_epoch``: packed rows, or length-bucketed batches, as the recipe says."""
        r, t = self.recipe, self.recipe.train
        if self.packing != "off":
            return iterate_packed(
                self.train_set,
                t.batch_size,
                self.pad_id,
                self.packing,
                self.pack_length,
                t.seed,
                r.data.mask_boundary_loss,
                start_epoch=start_epoch,
                skip=skip,
            )
        return iterate_batches(
            self.train_set,
            t.batch_size,
            self.pad_id,
            r.data.pad_to_multiple,
            t.seed,
            r.data.bucket_size,
            start_epoch=start_epoch,
            skip=skip,
        )

    def _run(self) -> dict:
        r, rd, con = self.recipe, self.run_dir, self.console
        t = r.train
        self._print_header()
        for cb in self.callbacks:
            cb.on_train_start(self)
        self.model.train()
        res = self._resumed or {}
        data_epoch, data_batch = res.get("data_epoch", 0), res.get("data_batch", 0)
        batches = self.batches(data_epoch, data_batch)

        if self.dry_run:
            return self._dry_run(batches)

        before = (
            self._task_metric("untrained", 0) if r.eval.exact_match and not self._resumed else None
        )
        mx.reset_peak_memory()
        start = time.perf_counter()
        step = res.get("step", 0)
        examples_seen = res.get("examples_seen", 0)
        self._loop = loop = _Loop(
            tokens_seen=res.get("tokens_seen", 0),
            window={**_new_window(), **(res.get("window") or {})},
            mark=start,
        )
        self._queued: list[_Step] = []
        self.best_eval = res.get("best_eval", math.inf)
        self.last_loss = res.get("last_loss", math.nan)
        first_row = res.get("first_row", True)

        def position():
            """Everything the loop needs to continue exactly from here (saved in checkpoints)."""
            self._read_steps()
            key = [int(v) for v in mx.random.state[0].tolist()]
            return {
                "step": step,
                "data_epoch": data_epoch,
                "data_batch": data_batch,
                "tokens_seen": loop.tokens_seen,
                "examples_seen": examples_seen,
                "window": dict(loop.window),
                "best_eval": self.best_eval,
                "last_loss": self.last_loss,
                "first_row": first_row,
                "rng": key,
                "scaler": {
                    "scale": self.scaler["scale"].item(),
                    "good": self.scaler["good"].item(),
                },
                "nonfinite": dict(self._nf),
                "micro_split": self._split,
            }

        self._position = position
        con.start_progress(self.total_steps)
        last_event = time.perf_counter()
        while step < self.total_steps:
            micro = []
            for _ in range(t.grad_accumulation):
                epoch_now, batch = next(batches)
                if epoch_now != data_epoch:
                    data_epoch, data_batch = epoch_now, 0
                data_batch += 1
                micro.append(batch)
            # The step is queued, not waited for: its results are read at log steps (and
            # wherever the loop needs them), so the host prepares the next batch meanwhile.
            scale = self.scaler["scale"]
            loss_sum, _, norm, ok = self._step_or_fall_back(micro, step + 1)
            step += 1
            n_tokens = sum(b.n_targets for b in micro)  # the host knows what the step counted as n
            record = _Step(step, n_tokens, loss_sum, norm, ok, scale, self.optimizer.learning_rate)
            self._queued.append(record)
            examples_seen += sum(b.examples for b in micro)
            loop.window["real"] += sum(b.n_tokens for b in micro)  # packing_utilization
            loop.window["room"] += sum(b.tokens.size for b in micro)
            if self.packing == "off":
                epoch_f = examples_seen / len(self.train_set)
            else:  # rows per epoch vary a little with each epoch's packing
                epoch_f = data_epoch + data_batch / self.batches_per_epoch
            log_now = step % t.log_every == 0 or step == self.total_steps
            if log_now or loop.first_step_time is None:  # the first step is timed on its own
                self._read_steps()
            now = time.perf_counter()
            event = StepEvent(step, epoch_f, now - last_event, record, self._read_steps)
            last_event = now
            for cb in self.callbacks:
                cb.on_step(self, event)
            con.advance(step, self.last_loss)

            if log_now:
                w = loop.window
                if not w["steps"]:  # only the first (compiling) step so far: it is all we have
                    w.update(timed_n=w["n"], time=loop.first_step_time, steps=1)
                row = {
                    "step": step,
                    "epoch": round(epoch_f, 4),
                    # null when every step since the last row was skipped
                    "loss": w["loss"] / w["n"] if w["n"] else None,
                    "grad_norm": record.grad_norm if math.isfinite(record.grad_norm) else None,
                    "lr": record.lr_value,
                    "tokens_seen": loop.tokens_seen,
                    "tokens_per_sec": w["timed_n"] / w["time"],
                    "step_time_s": w["time"] / w["steps"],
                    "peak_memory_gb": mx.get_peak_memory() / 1e9,
                    "time": time.time(),
                }
                if self.packing != "off":
                    row["packing_utilization"] = round(w["real"] / max(w["room"], 1), 4)
                if self.scaling != "none":
                    row["loss_scale"] = self.scaler["scale"].item()
                if self._nf["skipped"]:
                    row["skipped_steps"] = self._nf["skipped"]
                if first_row:
                    row["first_step_compile_time_s"] = loop.first_step_time
                    first_row = False
                rd.append_jsonl("metrics.jsonl", row)
                con.log_step(row, self.total_steps)
                loop.window = _new_window()

            asked = self._take_control()
            do_eval = "eval" in asked or (
                r.eval.every and step % r.eval.every == 0 and step != self.total_steps
            )
            do_samples = "sample" in asked or (
                r.samples.every and step % r.samples.every == 0 and step != self.total_steps
            )
            do_save = (r.checkpoints.every and step % r.checkpoints.every == 0) or self._save
            interrupted = self._interrupted  # read once: a signal may arrive meanwhile
            if do_eval or do_samples or do_save or self._stop or interrupted:
                self._read_steps()  # everything below needs the steps' results
            if do_eval:
                self._evaluate(step)
            if do_samples:
                self._samples(step)
            if do_save:
                self._save = False
                self._save_checkpoint(f"step-{step:06d}", step, self.last_loss)
                self._prune_checkpoints()
            if self._stop:
                self.log(f"stop requested: stopping after step {step}")
                break
            if interrupted:
                name = f"step-{step:06d}"
                if not (self.run_dir.checkpoints / name).exists():
                    self._save_checkpoint(name, step, self.last_loss)
                    self._prune_checkpoints()
                con.end_progress()
                recipe = self.recipe.source or "RECIPE.yaml"
                how = f"mlxtune run {recipe} --run-dir {self.run_dir.path} --resume"
                self.log(f"{interrupted} at step {step}: saved checkpoints/{name}")
                raise Interrupted(
                    f"interrupted ({interrupted}) after step {step}; checkpoint "
                    f"checkpoints/{name} saved. Resume with: {how}"
                )
            if not self._queued:  # read in this round: what came after it is not training time
                loop.mark = time.perf_counter()

        self._read_steps()
        con.end_progress()
        train_time = time.perf_counter() - start
        final_eval = self._evaluate(step)
        if r.samples.every:
            self._samples(step)
        if r.checkpoints.save_final:
            self._save_checkpoint("final", step, self.last_loss)
        after = self._task_metric("trained", step) if r.eval.exact_match else None
        self._export()
        summary = {
            "steps": step,
            "train_time_s": round(train_time, 2),
            "final_loss": self.last_loss,
            "final_eval_loss": final_eval["eval_loss"],
            "best_eval_loss": self.best_eval,
            "mean_step_time_s": loop.timed_s / loop.timed_steps
            if loop.timed_steps
            else loop.first_step_time,
            "first_step_compile_time_s": loop.first_step_time,
            "tokens_seen": loop.tokens_seen,
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            "run_dir": str(rd.path),
        }
        if before is not None:
            summary["exact_match_before"] = before
            summary["exact_match_after"] = after
        rd.write_json("summary.json", summary)
        con.summary(summary)
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary

    def _dry_run(self, batches) -> dict:
        t0 = time.perf_counter()
        micro = [next(batches)[1] for _ in range(self.recipe.train.grad_accumulation)]
        loss_sum, n, norm, _ = self._optimizer_step(micro)
        compile_s = time.perf_counter() - t0
        out = {
            "dry_run": True,
            "first_step_compile_time_s": round(compile_s, 3),
            "loss": loss_sum.item() / max(n.item(), 1),
            "grad_norm": norm.item(),
            "peak_memory_gb": mx.get_peak_memory() / 1e9,
            **self.derived(),
        }
        self.console.dry_run(out)
        self._tmp.cleanup()
        return out

    # ---------------------------------------------------------------- evaluation, samples
    def evaluate(self) -> dict:
        """Token-weighted validation loss and perplexity (no metrics row written)."""
        r = self.recipe
        self.model.eval()
        try:
            bs = r.eval.batch_size or r.train.batch_size
            total = 0.0
            count = 0
            for b in eval_batches(
                self.valid_set, bs, self.pad_id, r.data.pad_to_multiple, r.eval.max_batches
            ):
                loss, n = self._eval_step(mx.array(b.tokens), mx.array(b.mask))
                mx.eval(loss, n)
                total += loss.item()
                count += n.item()
        finally:
            self.model.train()
        eval_loss = total / max(count, 1)
        return {
            "eval_loss": eval_loss,
            "eval_ppl": math.exp(min(eval_loss, 50.0)),
            "eval_tokens": count,
        }

    def _evaluate(self, step: int) -> dict:
        m = self.evaluate()
        row = {"step": step, **m, "time": time.time()}
        self.run_dir.append_jsonl("metrics.jsonl", row)
        self.console.log_eval(row)
        if m["eval_loss"] < self.best_eval:
            self.best_eval = m["eval_loss"]
            if self.recipe.checkpoints.save_best:
                self._save_checkpoint(
                    "best", step, self.last_loss, extra={"eval_loss": m["eval_loss"]}
                )
        for cb in self.callbacks:
            cb.on_eval(self, row)
        return m

    def _task_metric(self, when: str, step: int) -> float:
        r = self.recipe
        examples = [e for e in self.test_set.examples if e.prompt_ids][: r.eval.exact_match]
        if not examples:
            raise UserInputError(
                "eval.exact_match needs completion, instruction or chat data", "eval.exact_match"
            )
        acc, rows = exact_match(self.model, self.tokenizer, examples, r.eval.max_new_tokens)
        self.run_dir.append_jsonl(
            "metrics.jsonl",
            {
                "step": step,
                f"exact_match_{'before' if when == 'untrained' else 'after'}": acc,
                "exact_match_examples": len(examples),
                "time": time.time(),
            },
        )
        self.run_dir.write_json(f"exact_match_{when}.json", rows)
        self.console.info(
            f"exact match ({when}): {100 * acc:.1f}% of {len(examples)} held-out examples"
        )
        return acc

    def _samples(self, step: int):
        r = self.recipe.samples
        if r.prompts:
            prompts = list(r.prompts)
            ids = [list(self.tokenizer.encode(p)) for p in prompts]
        else:  # validation prompts, as the model reads them in training
            chosen = [e for e in self.valid_set.examples if e.prompt_ids][: r.count]
            prompts, ids = [e.prompt for e in chosen], [e.prompt_ids for e in chosen]
        if not prompts:
            return
        new = generate_ids(
            self.model, ids, r.max_new_tokens, eos_ids(self.tokenizer), r.temperature, seed=step
        )
        outs = [self.tokenizer.decode(n) for n in new]
        for p, o in zip(prompts, outs, strict=True):
            self.run_dir.append_jsonl(
                "samples.jsonl", {"step": step, "prompt": p, "completion": o, "time": time.time()}
            )
        self.console.sample(step, prompts[0], outs[0])

    # ---------------------------------------------------------------- checkpoints, export
    def trainable_weights(self) -> dict:
        return dict(tree_flatten(self.model.trainable_parameters()))

    @property
    def trained(self) -> TrainedModel:
        """The model being trained, with what it came from, for checkpoints and exports."""
        a = self.recipe.adapter
        adapter = {
            "type": a.type,
            "rank": a.rank,
            "alpha": a.alpha,
            "dropout": a.dropout,
            "targets": list(a.targets),
            "layers": self.adapter_info.get("layers"),
            "adapted": self.adapter_info["adapted"],
        }
        return TrainedModel(
            self.model,
            self.tokenizer,
            self.model_config,
            adapter,
            self.model_dir,
            self.tokenizer_dir,
        )

    def _save_checkpoint(self, name: str, step: int, loss: float, extra: dict | None = None):
        meta = {
            "step": step,
            "loss": loss,
            "lr": self.optimizer.learning_rate.item(),  # the rate of the last step taken
            "time": time.time(),
            **(extra or {}),
        }
        t = self.trained
        state = {
            **meta,
            "base_model_dir": str(Path(t.base_dir).resolve()) if t.base_dir else None,
            "tokenizer_dir": str(Path(t.tokenizer_dir).resolve()) if t.tokenizer_dir else None,
            "model_config": t.model_config,
            "dtype": self.recipe.model.dtype,
            "adapter": t.adapter,
            "recipe": self.recipe.to_dict(),
        }
        position = getattr(self, "_position", None)
        if position is not None:
            state["resume"] = position()
        with self.run_dir.staged("checkpoints", name) as tmp:
            write_mlx_lm(t, tmp, meta)
            if position is not None:
                opt = dict(tree_flatten(self.optimizer.state))
                mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
                if self._masters[0] is not None:
                    masters = dict(tree_flatten(self._masters[0]))
                    mx.save_safetensors(str(tmp / "masters.safetensors"), masters)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            write_checksums(tmp)
        self.log(f"saved checkpoint checkpoints/{name} at step {step}")

    def _load_resume(self, which: str):
        """Put back the weights, optimizer state, random state and loop position of a checkpoint,
        and cut metrics and samples back to its step."""
        ckpt = pick_checkpoint(self.run_dir.path, which, lambda m: self.log(f"WARNING: {m}"))
        state = json.loads((ckpt / "trainer_state.json").read_text())
        res = state.get("resume")
        if res is None:
            raise UserInputError("this checkpoint holds no resume state", str(ckpt))
        ok, refused = recipe_changes(state.get("recipe", {}), self.recipe.to_dict())
        if refused:
            raise UserInputError(
                "the recipe changed in ways a resumed run cannot honour: " + "; ".join(refused),
                refused[0].split(":")[0],
            )
        for line in ok:
            self.log(f"resuming with a changed recipe: {line}")
        weights = str(ckpt / "adapters.safetensors")
        load_trainable_weights(
            self.model, mx.load(weights), weights
        )  # every trainable weight, by name and shape
        masters = ckpt / "masters.safetensors"
        if self._masters[0] is not None:
            if not masters.exists():
                raise UserInputError(
                    "this checkpoint holds no fp32 master weights (precision.master_weights "
                    "was off, or model.dtype was float32)",
                    str(ckpt),
                )
            loaded = mx.load(str(masters))
            load_trainable_weights(self.model, loaded, str(masters))  # checks names and shapes
            self._masters[0] = self.model.trainable_parameters()  # now fp32: the masters
            self.model.update(tree_map(lambda w, dt: w.astype(dt), self._masters[0], self._dtypes))
        saved = mx.load(str(ckpt / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(saved.items()))
        # fills in the structure around what was saved (frozen layers hold empty states)
        self.optimizer.init(self._opt_params())
        if "scaler" in res:
            self.scaler["scale"] = mx.array(float(res["scaler"]["scale"]))
            self.scaler["good"] = mx.array(int(res["scaler"]["good"]), dtype=mx.int32)
        self._nf.update(res.get("nonfinite", {}))
        self._split = int(res.get("micro_split", 1))
        hi, lo = res["rng"]
        mx.random.seed((int(hi) << 32) | int(lo))
        mx.eval(self.model.parameters(), self.optimizer.state)
        step = res["step"]
        for name in ("metrics.jsonl", "samples.jsonl"):
            rows = self.run_dir.read_jsonl(name)
            if rows:
                kept = [row for row in rows if row.get("step", 0) <= step]
                self.run_dir.write_text(name, "".join(json.dumps(r) + "\n" for r in kept))
        self._resumed = res
        self.log(f"resumed from checkpoints/{ckpt.name} at step {step}")

    def _prune_checkpoints(self):
        keep = self.recipe.checkpoints.keep_last
        steps = sorted(p for p in self.run_dir.checkpoints.iterdir() if p.name.startswith("step-"))
        for p in steps[:-keep]:
            shutil.rmtree(p)

    def _export(self):
        # fused and gguf last: they merge the adapters into the model in place
        fmts = sorted(self.recipe.export.formats, key=lambda f: f in ("fused", "gguf"))
        for fmt in fmts:
            with self.run_dir.staged("export", fmt) as tmp:
                export(self.trained, fmt, tmp, self.recipe.model.dtype if fmt == "fused" else None)
            self.log(f"exported {fmt} to {self.run_dir.path / 'export' / fmt}")

    # ---------------------------------------------------------------- output
    def log(self, message: str):
        held = getattr(self, "_held_logs", None)
        if held is not None:
            held.append(message)
        else:
            self.run_dir.log(message)
        self.console.info(message)

    def _print_header(self):
        d = self.derived()
        r = self.recipe
        a = r.adapter
        kind = a.type if a.type == "full" else f"{a.type} r={a.rank} alpha={a.alpha}"
        self.console.header(
            [
                f"run      {self.run_dir.path}" + ("  (dry run)" if self.dry_run else ""),
                f"model    {self.model_dir or 'new ' + self.model_config['model_type']}  ({d['total_parameters']:,} parameters, {r.model.dtype})",
                f"adapter  {kind}: {d['trainable_parameters']:,} trainable ({d['trainable_percent']:.2f}%)"
                + (f" in {d['adapted_modules']} linear layers" if d["adapted_modules"] else ""),
                f"data     train {d['train_data']}",
                f"         valid {d['valid_data']}",
                f"train    {d['effective_steps']} steps ({d['epochs']} epochs), {d['examples_per_step']} examples/step, "
                f"{r.optimizer.name} lr {r.optimizer.lr:g} {r.schedule.name}",
                f"backend  {d['device']}, BLAS: {d['blas']}",
            ]
        )


def _new_window() -> dict:
    return {"loss": 0.0, "n": 0, "timed_n": 0, "time": 0.0, "steps": 0, "real": 0, "room": 0}


__all__ = ["Trainer", "Callback", "StepEvent", "Dataset"]
