"""The trainer: one loop, readable top to bottom (``Trainer._train``). It calls ``build`` for the
components, the objective for batches and evaluation, the engine for steps, and ``checkpoint``
to save and resume; none of them knows about the loop."""

from __future__ import annotations

import contextlib
import copy
import itertools
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .. import _malloc, distributed
from ..config import Recipe
from ..console import Console
from ..engine import memory
from ..engine.state import LoopPosition
from ..errors import Interrupted, TrainingError
from ..evaluate import answerable, exact_match, sample
from ..export import TrainedModel
from ..generate import led_by_rank0
from ..models import kernel_attention
from ..runs.checkpoint import last_saved
from ..runs.rundir import RunDir, removed_if_refused, run_dir_for
from . import describe, stopping
from .callbacks import Callback, FunctionCallback, StepEvent, StepRecord
from .control import Signals, agree_after_step, take_requests
from .ending import dry_run, export_all, restore_best
from .ending import summary as ending_summary
from .guard import Guard
from .meter import StepMeter, merge_host
from .records import Records
from .saving import Saver
from .setup import all_ranks_set_up, record, run_folders, set_up


class Trainer:
    """Builds everything a recipe names, then trains it with ``run()``.

    >>> trainer = Trainer(load_recipe("recipes/quickstart.yaml"), run_dir="runs/demo")
    >>> summary = trainer.run()

    ``resume``: continue the run in ``run_dir`` from "latest" (its newest intact checkpoint) or
    from a named checkpoint, exactly where it stopped.
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
        self._given, self.dry_run, self.resume_from = recipe, dry_run, resume
        self.world = distributed.current()
        """The ranks training together (``mlx.launch``); rank 0 alone writes the run."""
        if not self.world.main:
            console = Console(quiet=True, progress=False)
        self.callbacks = [c if isinstance(c, Callback) else FunctionCallback(c) for c in callbacks]
        self.console = console or Console(quiet=False, progress=recipe.train.progress)
        self.position = LoopPosition()
        self.resumed = False
        self._start_eval: dict | None = None
        self._stop = self._save = False
        self._stopped_early = False
        self._last_eval: tuple[int, dict] | None = None
        """The latest evaluation: (step, metrics)."""
        self._meter = StepMeter()
        self.saver = Saver(self)
        self.guard = Guard(self)
        """The lines a run that stops short ends with (a failed write, a lost step)."""
        self._signals = Signals(self._on_signal, not dry_run, self.guard.lost_at_once)
        self._held_logs: list[str] | None = []  # log lines wait until the input is accepted
        self._tmp = None
        if dry_run or not self.world.main:  # a scratch run directory, removed at the end
            prefix = "mlxtune-dry-" if dry_run else f"mlxtune-rank{self.world.rank}-"
            self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self._source: RunDir | None = None
        """Where a resumed run's checkpoints are read (the run directory, also on ranks that
        write elsewhere)."""
        new_run = not dry_run and resume is None and self.world.main
        path = run_dir_for(recipe, run_dir) if new_run else None
        # refused input (here or on another rank) leaves no run folder behind
        with removed_if_refused(path), all_ranks_set_up(self.world):
            scratch = self._tmp.name if self._tmp is not None else None
            where = path if new_run else run_dir
            self.run_dir, self._source = run_folders(
                recipe, where, resume, dry_run, self.world, scratch
            )
            self.records = Records(self.run_dir, self.console)
            """Where the metrics rows and samples go: the run directory and the reporters."""
            self.parts = set_up(
                recipe,
                self.run_dir,
                self._source,
                self.world,
                self.log,
                rows=self.console.rows,
                resume_from=resume,
                dry_run=dry_run,
            )
            """What the recipe was made into (``setup.Run``): one value, which the loop reads."""
            # the loop's own position, moved on step by step; parts.start stays where it began
            self.position = copy.deepcopy(self.parts.start)
            self.resumed = self.parts.resumed
            record(self)
            held, self._held_logs = self._held_logs, None
            for line in held:  # the input was accepted
                self.run_dir.log(line)

    # ---------------------------------------------------------------- what was built
    @property
    def recipe(self) -> Recipe:
        """The recipe as resolved (``Run.recipe``: each ``auto`` its value) once set up; until
        then the one given, which the run never writes into."""
        parts = self.__dict__.get("parts")
        return parts.recipe if parts is not None else self._given

    blas = property(lambda self: self.parts.blas)
    tiers = property(lambda self: self.parts.tiers, doc="The kernel tiers: loss, attention.")
    built = property(lambda self: self.parts.built)
    objective = property(lambda self: self.parts.objective)
    auto_sizes = property(lambda self: self.parts.auto_sizes)
    batches_per_epoch = property(lambda self: self.parts.batches_per_epoch)
    total_steps = property(lambda self: self.parts.total_steps)
    optimizer = property(lambda self: self.parts.optimizer)
    engine = property(lambda self: self.parts.engine)
    memory_estimate = property(lambda self: self.parts.memory_estimate)
    model = property(lambda self: self.built.components.model)
    tokenizer = property(lambda self: self.built.components.tokenizer)
    train_set = property(lambda self: self.built.components.train_set)
    streamed = property(
        lambda self: getattr(self.train_set, "streamed", False),
        doc="The training set is read as a stream (data.streaming).",
    )
    valid_set = property(lambda self: self.built.components.valid_set)
    test_set = property(lambda self: self.built.components.test_set)
    pad_id = property(lambda self: self.built.components.pad_id)
    model_config = property(lambda self: self.built.model_config)
    scaling = property(
        lambda self: self.engine.scaling, doc="The loss scaling: dynamic, static or none."
    )

    @property
    def generates(self) -> bool:
        """Whether this rank draws samples and exact-match answers: rank 0, and in a fully
        sharded run every rank (its forward gathers from all of them), each taking rank 0's
        tokens (``led_by_rank0``)."""
        return self.world.main or self.engine.sharded

    def _generating(self):
        """Where this rank decodes: in step with rank 0 in a fully sharded run."""
        if self.engine.sharded:
            return led_by_rank0(self.world.group)
        return contextlib.nullcontext()

    @property
    def last_loss(self) -> float:
        """The mean loss of the last applied step read so far."""
        return self.position.last_loss

    @property
    def trained(self) -> TrainedModel:
        """The model being trained, with what it came from, for checkpoints and exports."""
        return self.built.trained(self.recipe)

    def batches(self, start_epoch: int = 0, skip: int = 0):
        """The endless (epoch, batch) stream the run trains on (the objective's)."""
        return self.objective.batches(start_epoch, skip)

    # ---------------------------------------------------------------- steering
    def request_stop(self):
        """Finish the current step, save, export as the recipe says, and return."""
        self._stop = True

    def request_save(self):
        """Save a checkpoint after the current step."""
        self._save = True

    def _on_signal(self, name: str):
        self.console.info(
            f"{name}: finishing this step, then saving a checkpoint (again to stop at once)"
        )

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
            self._meter.mark = time.perf_counter()
        self._save |= "save" in asked
        self._stop |= "stop" in asked
        return asked

    # ---------------------------------------------------------------- the loop
    def run(self) -> dict:
        """Train as the recipe says; returns the summary (also printed and logged).

        On SIGINT or SIGTERM (in the main thread) the current step finishes, a checkpoint is
        saved and ``Interrupted`` is raised, saying how to resume; a second signal stops at once.
        """
        r, failed = self.recipe, True
        try:
            if self.world.main and not self.dry_run:
                self.records.open(r, self.position.step if self.resumed else None)
            with self._signals, self.guard.watchdog():
                if self.tiers["attention"] == "off":
                    out = self._run()
                else:
                    with kernel_attention(self.model, self.tiers["attention"]):
                        out = self._run()
            failed = False
            return out
        except RuntimeError as e:
            if (note := memory.resource_limit_note(e)) is None:
                raise
            raise TrainingError(f"{e}: {note}") from None
        except OSError as e:  # a write failed: the disk is full, the folder read-only
            what = Path(e.filename).name if e.filename else "the run directory"
            raise TrainingError(self.guard.write_failed(what, e)) from None
        finally:
            self.records.close(failed)
            if self.streamed:
                self.train_set.close()

    def _run(self) -> dict:
        r, pos = self.recipe, self.position
        self._print_header()
        for cb in self.callbacks:
            cb.on_train_start(self)
        self.model.train()
        batches = self.batches(pos.data_epoch, pos.data_batch)
        if self.dry_run:
            out = {**dry_run(r, self.objective, self.engine, self.world, batches), **self.derived()}
            self.console.dry_run(out)
            self._tmp.cleanup()
            return out
        before = (
            self._exact_match("untrained", 0)
            if r.eval.exact_match and not self.resumed and self.generates
            else None
        )
        self._start_eval = self._evaluate(0) if r.eval.at_start and not self.resumed else None
        mx.reset_peak_memory()
        start = time.perf_counter()
        self._meter = StepMeter(mark=start)
        self.console.start_progress(self.total_steps)
        self._train(batches)
        self._read_steps()
        self.console.end_progress()
        return self._finish(time.perf_counter() - start, before)

    def _train(self, batches):
        """Step until the recipe's last step, a stop request, or a signal."""
        t, pos, engine = self.recipe.train, self.position, self.engine
        last_event = time.perf_counter()
        while pos.step < self.total_steps:
            if t.qat is not None and not engine.qat_on and pos.step >= t.qat.start_step:
                engine.start_qat()
                self.log(f"step {pos.step + 1}: quantization-aware training starts")
            micro = []
            for _ in range(t.grad_accumulation):
                epoch_now, batch = next(batches)
                if epoch_now != pos.data_epoch:
                    pos.data_epoch, pos.data_batch = epoch_now, 0
                pos.data_batch += 1
                if self.streamed:
                    pos.data_stream = self.train_set.state.to_json()
                micro.append(batch)
            # The step is queued, not waited for: its results are read at log steps (and
            # wherever the loop needs them), so the host prepares the next batch meanwhile.
            scale = engine.scaler["scale"]  # the one this step multiplies by
            result = engine.step_or_fall_back(micro, pos.step + 1, self.log)
            lr = self.optimizer.learning_rate  # the one this step used
            pos.step += 1
            n = sum(self.objective.count(b) for b in micro)  # what the step counted
            uses = [self.objective.usage(b) for b in micro]
            targets = sum(u.targets for u in uses)
            record = StepRecord(pos.step, n, targets, result, scale, lr)
            for b in micro:
                merge_host(record.host, self.objective.host_metrics(b))
            self._meter.queued.append(record)
            for use in uses:
                pos.examples_seen += use.examples
                pos.window.real += use.tokens  # packing_utilization
                pos.window.room += use.room
            epoch = self._epoch()
            log_now = pos.step % t.log_every == 0 or pos.step == self.total_steps
            if log_now or self._meter.first_step is None:  # the first step is timed alone
                self._read_steps()
            m = self.recipe.memory  # after the read: the step's freed buffers are cached now
            if memory.should_clear_cache(
                pos.step, mx.get_cache_memory(), m.clear_cache_every, m.clear_cache_gb
            ):
                mx.clear_cache()
            now = time.perf_counter()
            event = StepEvent(pos.step, epoch, now - last_event, record, self._read_steps)
            last_event = now
            for cb in self.callbacks:
                cb.on_step(self, event)
            self.console.advance(pos.step, pos.last_loss)
            if log_now:
                self._log_row(epoch, record)
            if self._between_steps():
                break

    def _epoch(self) -> float:
        pos = self.position
        if self.streamed:  # the share of the source the epoch has read
            return pos.data_epoch + (self.train_set.fraction() or 0.0)
        if self.recipe.data.packing == "off":
            return pos.examples_seen / len(self.train_set)
        # rows per epoch vary a little with each epoch's packing
        return pos.data_epoch + pos.data_batch / self.batches_per_epoch

    def _between_steps(self) -> bool:
        """Control requests, evaluation, samples, checkpoints and signals after a step; True
        to stop training."""
        r, step = self.recipe, self.position.step
        asked = self._take_control() if self.world.main else set()
        interrupted = self._signals.caught  # read once: a signal may arrive meanwhile
        if self.world.size > 1:  # rank 0's requests; any rank's save, stop and signals
            asked, self._save, self._stop, interrupted = agree_after_step(
                self.world, asked, self._save, self._stop, interrupted
            )
        last = step == self.total_steps
        do_eval = "eval" in asked or (r.eval.every and step % r.eval.every == 0 and not last)
        do_samples = "sample" in asked or (
            r.samples.every and step % r.samples.every == 0 and not last
        )
        do_save = (r.checkpoints.every and step % r.checkpoints.every == 0) or self._save
        if do_eval or do_samples or do_save or self._stop or interrupted:
            self._read_steps()  # everything below needs the steps' results
        if do_eval:
            self._evaluate(step)
        if do_samples:
            self._samples(step)
        if do_save:
            self._save = False
            self._checkpoint(f"step-{step:06d}")
        if do_eval or do_samples or do_save:
            _malloc.trim()  # what that work freed goes back: RSS stays the steps' own
        if self._stop:
            if not self._stopped_early:  # that one said why already
                self.log(f"stop requested: stopping after step {step}")
            return True
        if interrupted:
            name = f"step-{step:06d}"
            if not (self.run_dir.checkpoints / name).exists():
                self._checkpoint(name)
            self.world.barrier()  # no rank leaves before rank 0 has saved
            self.console.end_progress()
            how = self.guard.resume_command()
            self.log(f"{interrupted} at step {step}: saved checkpoints/{name}")
            raise Interrupted(
                f"interrupted ({interrupted}) after step {step}; checkpoint "
                f"checkpoints/{name} saved. Resume with: {how}"
            )
        if not self._queued:  # read in this round: what came after it is not training time
            self._meter.mark = time.perf_counter()
        return False

    def _read_steps(self):
        """Wait for the queued steps (one wait for all of them) and account for each."""
        with distributed.collectives(self.world):
            self._meter.read(
                self.position, self.engine, self._log_quietly, lambda: last_saved(self.run_dir)
            )

    @property
    def _queued(self) -> list[StepRecord]:
        return self._meter.queued

    def _log_row(self, epoch: float, record: StepRecord):
        packed = self.recipe.data.packing != "off"
        row = self._meter.row(self.position, self.engine, epoch, record, packed)
        if self.world.size > 1:
            row["world_size"] = self.world.size
        self.records.row(row)
        self.console.log_step(row, self.total_steps)

    def _finish(self, train_time: float, before: float | None) -> dict:
        r, pos, meter = self.recipe, self.position, self._meter
        seen = self._last_eval  # early stopping evaluated this step already
        final_eval = seen[1] if seen and seen[0] == pos.step else self._evaluate(pos.step)
        best = None
        if r.checkpoints.load_best_at_end:
            best = restore_best(self.run_dir, self.engine, pos.step, self._last_eval[1], self.log)
        if best is not None:
            final_eval = best
        main = self.world.main  # the other ranks of a data-parallel run write nothing
        if r.samples.every:
            self._samples(pos.step)
        if r.checkpoints.save_final:
            self._checkpoint("final", prune_after=False)
        trained = r.eval.exact_match and self.generates
        after = self._exact_match("trained", pos.step) if trained else None
        if self.engine.sharded and r.export.formats:
            with distributed.collectives(self.world):  # the exports read whole blocks
                self.engine.unshard()
        if main:
            export_all(
                r, self.model, self.trained, self.run_dir, self.guard.writing, self.log,
                self.parts.stages,
            )  # fmt: skip
        summary = ending_summary(
            pos, meter, self.run_dir, train_time, final_eval, stopped_early=self._stopped_early,
            before=before, after=after, start_eval=self._start_eval, stages=self.parts.stages,
        )  # fmt: skip
        self.run_dir.write_json("summary.json", summary)
        self.console.summary(summary)
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary

    # ---------------------------------------------------------------- evaluation, samples
    def evaluate(self) -> dict:
        """The objective's validation metrics (for SFT: token-weighted loss and perplexity);
        no metrics row written."""
        self.model.eval()
        try:
            m = self.objective.evaluate(self.engine, self.world)
            if self.engine.qat:  # eval_loss is the quantized model's: the weights' beside it
                with self.engine.unquantized():
                    dense = self.objective.evaluate(self.engine, self.world)
                m["eval_loss_unquantized"] = dense["eval_loss"]
            return m
        finally:
            self.model.train()

    def _evaluate(self, step: int) -> dict:
        m = self.evaluate()
        self._last_eval = (step, m)
        row = {"step": step, **m, "time": time.time()}
        self.records.row(row)
        self.console.log_eval(row)
        better = self._watch(m)
        self.position.best_eval = min(self.position.best_eval, m["eval_loss"])
        if better and self.recipe.checkpoints.save_best:
            self._checkpoint("best", m, prune_after=False)
        self.records.samples(step, self.objective.eval_samples if self.world.main else [], True)
        for cb in self.callbacks:
            cb.on_eval(self, row)
        return m

    def _exact_match(self, when: str, step: int) -> float:
        n = self.recipe.eval.exact_match
        examples = list(itertools.islice(answerable(self.test_set.examples), n))
        with self._generating():
            acc, rows = exact_match(
                self.model, self.tokenizer, examples, self.recipe.eval.max_new_tokens
            )
        if not self.world.main:
            return acc
        key = f"exact_match_{'before' if when == 'untrained' else 'after'}"
        row = {"step": step, key: acc, "exact_match_examples": len(examples), "time": time.time()}
        self.records.row(row)
        self.run_dir.write_json(f"exact_match_{when}.json", rows)
        self.console.info(
            f"exact match ({when}): {100 * acc:.1f}% of {len(examples)} held-out examples"
        )
        return acc

    def _samples(self, step: int):
        if not self.generates:
            return
        with self._generating():
            drawn = sample(self.model, self.tokenizer, self.recipe.samples, self.valid_set, step)
        if self.world.main:
            self.records.samples(step, drawn)

    def _watch(self, m: dict) -> bool:
        """``stopping.watch`` on this evaluation (a stop it asks for ends the run here)."""
        better, stop = stopping.watch(self.recipe.train.early_stopping, self.position, m)
        if stop and not self._stop:
            self.log(stop)
            self._stop = self._stopped_early = True
        return better

    # ---------------------------------------------------------------- checkpoints, export
    def _checkpoint(self, name: str, extra: dict | None = None, prune_after: bool = True):
        self._read_steps()
        self.saver.save(name, extra, prune_after)

    # ---------------------------------------------------------------- output
    def log(self, message: str):
        if self._held_logs is not None:
            self._held_logs.append(message)
        else:
            self.run_dir.log(message)
        self.console.info(message)

    def _log_quietly(self, message: str, quiet: bool = False):
        """``log``, or the run's log file alone when ``quiet``."""
        self.run_dir.log(message) if quiet else self.log(message)

    def derived(self) -> dict:
        """What the recipe works out to: steps, epochs, sizes, data, device."""
        return describe.derived(self)

    def _print_header(self):
        self.console.header(describe.header(self))


__all__ = ["Trainer"]
