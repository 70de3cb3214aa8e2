"""The engine: the one place gradients are made and applied.

It compiles ``value_and_grad(objective.loss)`` over a batch pytree (the dict of arrays the
objective's ``arrays`` gives) and runs an optimizer step over one or more micro-batches:

    loss x scale / count  ->  backward  ->  (accumulate micro-batches)  ->  unscale in fp32
    ->  clip  ->  optimizer on the fp32 masters (or the weights)  ->  non-finite guard

The host announces the step's count (target tokens, pairs, ...) before the step runs, so each
micro-batch's gradients arrive already divided by the step's total and accumulation is a plain
sum. Gradients of all micro-batches meet in ``apply`` before anything reads them: in a
data-parallel run (``mlxtune.distributed``) each rank trains on its share of the batch's rows and
the gradients, loss sums and counts are summed over ranks there, once a step. Steps are queued on
the device (``mx.async_eval``), never waited for here (a data-parallel step waits once, for its
own gradients, so that the ranks agree on an out-of-memory split before they meet).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from .. import fsdp, qat, tensor
from ..distributed import World, collectives
from ..errors import TrainingError, UserInputError
from ..kernels import forward_only
from ..models import VisionLM, dropout_key, has_embedding_noise
from .memory import is_out_of_memory, resource_limit_note
from .persist import Persisted
from .precision import all_finite, make_masters, scaling_mode, select_into, snapshot, update_scale

TOWER = "tower"
"""Where ``Engine.arrays`` keeps a vision model's tower inputs when its tower trains."""


def _stepped(arrays: dict) -> dict:
    """``arrays`` as a compiled step takes them (without the tower's inputs)."""
    return {k: v for k, v in arrays.items() if k != TOWER}


class OutOfMemoryOnARank(MemoryError):
    """Some rank of a data-parallel step ran out of memory: every rank splits further."""


@dataclass(eq=False)
class StepResult:
    """One optimizer step's results, as lazy arrays until the device has run it."""

    loss_sum: mx.array
    count: mx.array
    norm: mx.array
    """The gradient norm before clipping."""
    ok: mx.array
    """Whether the update was applied (loss and gradients finite)."""
    metrics: dict[str, mx.array]
    """The objective's metric sums."""


class Engine(Persisted):
    """Compiled training steps for one model, optimizer and objective, with the precision
    policy (fp32 masters, loss scaling), clipping, the non-finite guard and the out-of-memory
    split a recipe asks for."""

    def __init__(self, model: nn.Module, optimizer, objective, recipe, world: World | None = None):
        self.model, self.optimizer, self.objective = model, optimizer, objective
        self.world = world or World()
        """The ranks training together (one, unless started by mlx.launch)."""
        self.precision = recipe.precision
        self.grad_clip = recipe.optimizer.grad_clip
        self.oom_fallback = recipe.memory.oom_fallback
        self.train = recipe.train
        self.scaling = scaling_mode(recipe.precision, recipe.model.dtype)
        """ "dynamic", "static" or "none"."""
        params = model.trainable_parameters()
        self.dtypes = tree_map(lambda w: w.dtype, params)
        self.masters: dict | None = make_masters(params, recipe.precision.master_weights)
        """fp32 copies of the 16-bit trainable weights (what the optimizer updates), or None."""
        init = recipe.precision.init_scale if self.scaling != "none" else 1.0
        self.scaler = {"scale": mx.array(init), "good": mx.array(0, dtype=mx.int32)}
        self.skipped = 0
        """Steps whose update was not applied, and the latest run of them in a row."""
        self.in_a_row = 0
        self.split = 1
        """Micro-batches each batch is split into (more after running out of memory)."""
        self._has_dropout = has_embedding_noise(model) or any(
            isinstance(m, nn.Dropout) and m._p_1 < 1 for _, m in model.named_modules()
        )
        self._tower_trains = isinstance(model, VisionLM) and model.tower_trains
        """A vision model with adapters in its tower: steps take the features' gradient
        through the tower (``grad_step``)."""
        trained = {k for k, _ in tree_flatten(params)}
        self.layout = fsdp if fsdp.is_sharded(model) else tensor if tensor.is_split(model) else None
        """How the model's weights are divided among the ranks: ``mlxtune.fsdp`` (each holds
        its pieces of every block), ``mlxtune.tensor`` (its heads and MLP columns), or None
        (each holds the whole model)."""
        self.pieces = frozenset(self.layout.sharded_paths(model) & trained if self.layout else ())
        """What trains as this rank's share: its squares sum over ranks for the norm (and a
        fully sharded run's gradients arrive summed over ranks)."""
        self.qat = bool(qat.prepared(model))
        """The model's layers are prepared for quantization-aware training (``train.qat``)."""
        q = recipe.train.qat
        self.qat_on = self.qat and q is not None and q.start_step == 0
        """Training steps compute with the weights fake-quantized (from train.qat.start_step:
        ``start_qat``)."""
        self._unquantized = False
        self._build()

    def start_qat(self) -> None:
        """From the next step on, train with the weights fake-quantized (the steps are traced
        again)."""
        if self.qat and not self.qat_on:
            self.qat_on = True
            self._build()

    @contextlib.contextmanager
    def unquantized(self):
        """Inside the block ``evaluate_batch`` computes with the weights as they are, not
        fake-quantized (a QAT run's eval_loss_unquantized)."""
        self._unquantized = True
        try:
            yield
        finally:
            self._unquantized = False

    @property
    def data_ranks(self) -> int:
        """The ranks a batch's rows are split among (tensor parallelism: none, every rank
        computes on the whole batch)."""
        return 1 if self.layout is tensor else self.world.size

    # ---------------------------------------------------------------- compiled steps
    def params(self) -> dict:
        """What the optimizer updates: the fp32 masters, or the trainable weights themselves."""
        return self.masters if self.masters is not None else self.model.trainable_parameters()

    @property
    def state(self) -> list:
        """Everything a step reads and writes (weights, optimizer state, random state, loss
        scaler, masters): what to ``mx.eval`` to wait for the queued steps."""
        return self._state

    def _rank_dropout(self):
        """Data-parallel with adapter dropout or NEFTune: every rank advances the shared random
        state alike (so rank 0's checkpoint holds the state of all of them, for any number of
        ranks) and draws its masks and noise from its own key split from it, so that ranks'
        rows get independent draws. Entered inside the traced step."""
        if self.data_ranks == 1 or not self._has_dropout:
            return contextlib.nullcontext()
        shared = mx.random.randint(0, 1 << 32, (2,), dtype=mx.uint32)
        return dropout_key(mx.random.split(shared, self.world.size)[self.world.rank])

    def _apply(self, grads, loss_sum):
        """Unscale, clip and apply summed gradients; the non-finite guard; the loss scaler."""
        scaler, p, model, opt = self.scaler, self.precision, self.model, self.optimizer
        # the gradients are d(loss sum)/d(weights) x scale / count: unscale them in fp32
        inv = 1.0 / scaler["scale"]
        grads = tree_map(lambda g: g.astype(mx.float32) * inv, grads)
        sq = self._squares(grads)
        ok = all_finite(loss_sum, sq)
        norm = mx.sqrt(sq)
        if self.grad_clip is not None:
            shrink = mx.minimum(self.grad_clip / (norm + 1e-6), 1.0)
            grads = tree_map(lambda g: g * shrink, grads)
        params = self.params()
        grads = tree_map(lambda g, w: g.astype(w.dtype), grads, params)
        before = snapshot(opt.state)
        new = opt.apply_gradients(grads, params)
        # a non-finite step changes nothing: weights, masters and optimizer state stay
        new = tree_map(lambda a, b: mx.where(ok, a, b), new, params)
        select_into(opt.state, before, ok)
        if self.masters is not None:
            select_into(self.masters, new)  # in place: the masters are part of the state
            model.update(tree_map(lambda w, dt: w.astype(dt), new, self.dtypes))
        else:
            model.update(new)
        if self.scaling == "dynamic":
            update_scale(
                scaler, ok, p.growth_factor, p.backoff_factor, p.growth_interval, p.min_scale
            )
        return norm, ok

    def _squares(self, grads) -> mx.array:
        """The gradients' sum of squares: the pieces' (each rank's share of a weight divided
        among the ranks: fsdp or tensor) summed over ranks, the rest's counted once."""
        flat = tree_flatten(grads)
        rest = sum((mx.sum(mx.square(g)) for k, g in flat if k not in self.pieces), mx.array(0.0))
        if not self.pieces:
            return rest
        mine = sum((mx.sum(mx.square(g)) for k, g in flat if k in self.pieces), mx.array(0.0))
        return self.world.all_sum(mine) + rest

    def _summed(self, grads):
        """Each rank's gradients, scaled by size / (all ranks' count), as the whole batch's:
        their mean over ranks (a piece's arrives summed over ranks already: over size)."""
        world, pieces = self.world, self.pieces
        if not pieces:
            return nn.average_gradients(grads, world.group)
        flat = tree_flatten(grads)
        rest = nn.average_gradients({k: g for k, g in flat if k not in pieces}, world.group)
        rest = dict(tree_flatten(rest))  # (it gives the tree back nested)
        return tree_map_with_path(lambda k, g: g / world.size if k in pieces else rest[k], grads)

    def _build(self):
        model, opt, objective, scaler = self.model, self.optimizer, self.objective, self.scaler
        opt.init(self.params())  # before compiling: the state's structure is then fixed

        def scaled_loss(model, batch, factor):
            with self._rank_dropout(), qat.quantizing(self.qat_on):
                loss, count, metrics = objective.loss(model, batch)
            return loss * factor, loss, count, metrics

        grad_fn = nn.value_and_grad(model, scaled_loss)
        state = [model.state, opt.state, mx.random.state, scaler]
        if self.masters is not None:
            state.append(self.masters)
        self._feature_grad_step = None
        if self._tower_trains:  # the same state as the other steps, masters included
            self._feature_grad_step = self._build_feature_grads(scaled_loss, state)

        @partial(mx.compile, inputs=state, outputs=state)
        def train_step(batch, inv):
            (_, loss, count, metrics), grads = grad_fn(model, batch, scaler["scale"] * inv)
            return (loss, count, metrics, *self._apply(grads, loss))

        @partial(mx.compile, inputs=state, outputs=state)
        def grad_step(batch, inv):
            (_, loss, count, metrics), grads = grad_fn(model, batch, scaler["scale"] * inv)
            return loss, count, metrics, tree_map(lambda g: g.astype(mx.float32), grads)

        @partial(mx.compile, inputs=state, outputs=state)
        def apply_step(grads, loss_sum):
            return self._apply(grads, loss_sum)

        world = self.world

        @partial(mx.compile, inputs=state, outputs=state)
        def reduce_apply_step(grads, loss_sum, count, metrics):
            grads = self._summed(grads)
            names = sorted(metrics)
            sums = world.all_sum(
                mx.stack([loss_sum, count.astype(mx.float32)] + [metrics[k] for k in names])
            )
            loss_sum, metrics = sums[0], {k: sums[2 + i] for i, k in enumerate(names)}
            return (loss_sum, sums[1].astype(count.dtype), metrics, *self._apply(grads, loss_sum))

        self._curvature_step = None
        if getattr(opt, "curvature_every", None):
            self._curvature_step = self._build_curvature(state)

        def evaluation(quantized: bool):
            @partial(mx.compile, inputs=[model.state])
            def eval_step(batch):
                # no backward follows: the loss kernel skips its gradient work
                with forward_only(), qat.quantizing(quantized):
                    return objective.loss(model, batch)

            return eval_step

        self._train_step, self._grad_step, self._apply_step = train_step, grad_step, apply_step
        self._reduce_apply_step = reduce_apply_step
        # a QAT run's model is evaluated as it ships, quantized (from its first evaluation)
        self._eval_step = evaluation(self.qat)
        self._dense_eval_step = evaluation(False) if self.qat else self._eval_step
        self._state = state

    def _build_feature_grads(self, scaled_loss, state: list):
        """``grad_step`` that also gives the gradient with respect to the batch's image
        ``features`` (a vision model whose tower trains: ``VisionLM.tower_gradients`` takes it
        through the tower, outside the compiled step)."""
        model, scaler = self.model, self.scaler

        def loss_of(params, features, batch, factor):
            model.update(params)
            return scaled_loss(model, {**batch, "features": features}, factor)

        grad_fn = mx.value_and_grad(loss_of, argnums=(0, 1))

        @partial(mx.compile, inputs=state, outputs=state)
        def feature_grad_step(batch, inv):
            rest = {k: v for k, v in batch.items() if k != "features"}
            factor = scaler["scale"] * inv
            out, (grads, d_features) = grad_fn(
                model.trainable_parameters(), batch["features"], rest, factor
            )
            _, loss, count, metrics = out
            grads = tree_map(lambda g: g.astype(mx.float32), grads)
            return loss, count, metrics, grads, d_features.astype(mx.float32)

        return feature_grad_step

    def _build_curvature(self, state: list):
        """Sophia's curvature pass: the gradient of the mean loss against labels the model
        draws itself (``Objective.sampled_loss``), averaged over ranks, handed to the optimizer
        with the number of targets it averaged (left out when not finite)."""
        model, opt, objective, world = self.model, self.optimizer, self.objective, self.world
        if not hasattr(objective, "sampled_loss"):
            raise UserInputError(
                f"sophia estimates curvature from labels the model draws itself, which the "
                f"{objective.name} objective does not have; use another optimizer.name",
                "optimizer.name",
            )

        def drawn_loss(model, batch, scale):
            with qat.quantizing(self.qat_on):
                loss, count = objective.sampled_loss(model, batch)
            return loss * scale / mx.maximum(count, 1), count

        grad_fn = nn.value_and_grad(model, drawn_loss)

        @partial(mx.compile, inputs=state, outputs=state)
        def curvature_step(batch):
            scale = self.scaler["scale"]
            (loss, count), grads = grad_fn(model, batch, scale)
            grads = tree_map(lambda g: g.astype(mx.float32) / scale, grads)
            if world.size > 1:  # the mean over every rank's targets, each weighted by its count
                count_all = world.all_sum(count.astype(mx.float32))
                grads = tree_map(lambda g: g * (count * world.size / count_all), grads)
                grads = nn.average_gradients(grads, world.group)
                count = count_all
            sq = sum(mx.sum(mx.square(g)) for _, g in tree_flatten(grads))
            opt.update_curvature(grads, count.astype(mx.float32), all_finite(loss, sq))
            return count

        return curvature_step

    def arrays(self, batch) -> dict[str, mx.array]:
        """The objective's batch as the device arrays a step takes (a vision model's images
        through its tower, here; where the tower trains, its inputs kept under ``TOWER``)."""
        out = {k: mx.array(v) for k, v in self.objective.arrays(batch).items()}
        if isinstance(self.model, VisionLM):
            tower = {k: out[k] for k in self.model.family.tower_keys if k in out}
            out = self.model.prepare(out)
            if self._tower_trains and tower:
                out[TOWER] = tower
        return out

    def grad_step(self, arrays: dict[str, mx.array], inv_count: mx.array):
        """Forward and backward over one micro-batch (as ``arrays`` gives it): (loss sum,
        count, metric sums, fp32 gradients of loss x scale x ``inv_count``); nothing is
        updated. A vision model whose tower trains gets its tower's gradients too."""
        tower = arrays.get(TOWER)
        if tower is None:
            return self._grad_step(_stepped(arrays), inv_count)
        loss, count, metrics, grads, d_features = self._feature_grad_step(
            _stepped(arrays), inv_count
        )
        more = self.model.tower_gradients(tower, d_features)
        grads = tree_map_with_path(lambda k, g: g + more[k] if k in more else g, grads)
        return loss, count, metrics, grads

    def apply_step(self, grads, loss_sum: mx.array):
        """Apply gradients ``grad_step`` made (summed over micro-batches): (norm, ok)."""
        return self._apply_step(grads, loss_sum)

    def evaluate_batch(self, batch):
        """(loss sum, count, metric sums) of the objective on ``batch``, no gradients."""
        step = self._dense_eval_step if self._unquantized else self._eval_step
        return step(_stepped(self.arrays(batch)))

    # ---------------------------------------------------------------- optimizer steps
    def step(self, micro_batches: list, total: int | None = None) -> StepResult:
        """One optimizer step over micro-batches, queued on the device without waiting for it.
        ``total``: what the whole step counts (all ranks' micro-batches; by default these).
        A step that is not finite leaves every weight and optimizer state as it was."""
        if total is None:
            total = sum(self.objective.count(b) for b in micro_batches)
        # each rank's gradients are summed over ranks and divided by their number: x size here
        inv = mx.array(self.data_ranks / max(total, 1), dtype=mx.float32)
        if len(micro_batches) == 1 and self.world.size == 1 and not self._tower_trains:
            loss, count, metrics, norm, ok = self._train_step(self.arrays(micro_batches[0]), inv)
            mx.async_eval(self._state, loss, count, metrics, norm, ok)
            return StepResult(loss, count, norm, ok, metrics)
        if self.world.size > 1:
            return self._parallel_step(micro_batches, inv)
        loss_sum, count_sum, metric_sums, acc = self._accumulate(micro_batches, inv)
        norm, ok = self._apply_step(acc, loss_sum)
        mx.async_eval(self._state, norm, ok)
        return StepResult(loss_sum, count_sum, norm, ok, metric_sums)

    def _accumulate(self, micro_batches: list, inv: mx.array):
        """(loss sum, count, metric sums, gradients) summed over micro-batches, queued."""
        acc = loss_sum = count_sum = metric_sums = None
        for b in micro_batches:
            loss, count, metrics, grads = self.grad_step(self.arrays(b), inv)
            if acc is None:
                acc, loss_sum, count_sum, metric_sums = grads, loss, count, metrics
            else:
                acc = tree_map(mx.add, acc, grads)
                loss_sum, count_sum = loss_sum + loss, count_sum + count
                metric_sums = tree_map(mx.add, metric_sums, metrics)
            mx.async_eval(acc, loss_sum, count_sum, metric_sums)
        return loss_sum, count_sum, metric_sums, acc

    def _parallel_step(self, micro_batches: list, inv: mx.array) -> StepResult:
        """This rank's gradients, then (once every rank has its own, or ran out of memory,
        which the ranks agree on) their sum over ranks and the update.

        All of it is a wait on the others (``collectives``): queuing work (``mx.async_eval``)
        blocks too once MLX has enough tasks in flight, and the last step's all-reduce, still
        queued, is one of them; a peer that froze would otherwise hold this rank unseen."""
        with collectives(self.world):
            return self._parallel_step_waited(micro_batches, inv)

    def _parallel_step_waited(self, micro_batches: list, inv: mx.array) -> StepResult:
        failed = None
        try:
            loss_sum, count_sum, metric_sums, acc = self._accumulate(micro_batches, inv)
            mx.eval(acc, loss_sum, count_sum, metric_sums)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failed = e
        if self.world.agree([failed is not None])[0] > 0:
            raise OutOfMemoryOnARank(str(failed) if failed else "on another rank")
        if self.data_ranks > 1:
            loss_sum, count_sum, metric_sums, norm, ok = self._reduce_apply_step(
                acc, loss_sum, count_sum, metric_sums
            )
        else:  # tensor parallelism: every rank's gradients are its share already
            norm, ok = self._apply_step(acc, loss_sum)
        mx.async_eval(self._state, loss_sum, count_sum, metric_sums, norm, ok)
        return StepResult(loss_sum, count_sum, norm, ok, metric_sums)

    def shares(self, batch) -> list:
        """``batch`` split among the ranks (``Objective.split``): rank r's share is item r (a
        small batch may leave some ranks none)."""
        return [batch] if self.data_ranks == 1 else self.objective.split(batch, self.data_ranks)

    def shard(self, batch):
        """This rank's part of ``batch``; a rank left without rows gets a batch that counts
        nothing."""
        parts = self.shares(batch)
        if self.data_ranks == 1:
            return parts[0]
        if self.world.rank < len(parts):
            return parts[self.world.rank]
        return self.objective.nothing(parts[0])

    def _parts(self, share) -> list:
        """A rank's share as micro-batches: the objective's passes (``Objective.micro``), each
        split into ``self.split``."""
        o = self.objective
        return [p for m in o.micro(share) for p in o.split(m, self.split)]

    def micro_batches(self, batches: list) -> list:
        """This rank's micro-batches of the step's batches: its share of each, as the
        objective's passes split into ``self.split``. Data-parallel, every rank gets as many as
        the rank with the most (the others pad with batches that count nothing), so that every
        rank draws from the shared random state (dropout) as often as the others."""
        out = []
        for b in batches:
            mine = self._parts(self.shard(b))
            if self.data_ranks > 1:
                most = max(len(self._parts(s)) for s in self.shares(b))
                mine += [self.objective.nothing(mine[0])] * (most - len(mine))
            out += mine
        return out

    def step_or_fall_back(self, batches: list, step: int, log) -> StepResult:
        """``step`` over the step's batches (this rank's share of each), each split into
        ``self.split`` micro-batches; out of memory (on any rank), the split doubles (the same
        examples per step) and the step is retried."""
        total = sum(self.objective.count(b) for b in batches)
        while True:
            parts = self.micro_batches(batches)
            saved = snapshot(self._state) if self.oom_fallback else None
            try:
                every = getattr(self.optimizer, "curvature_every", None)
                if every and (step - 1) % every == 0:  # before the update, from the first step
                    self._curvature_step(_stepped(self.arrays(parts[0])))
                return self.step(parts, total)
            except Exception as e:
                if saved is None or not is_out_of_memory(e):
                    raise
                select_into(self._state, saved)  # the failed step left nothing behind
                del parts
                mx.clear_cache()
                # the same on every rank: the largest share of any rank
                o = self.objective
                rows = max(o.units(m) for b in batches for s in self.shares(b) for m in o.micro(s))
                if self.split >= rows:
                    raise TrainingError(
                        f"step {step}: out of memory even with micro-batches of one example "
                        f"({e}); use a shorter data.max_length, adapter.type: lora, or "
                        "model.dtype: bfloat16"
                    ) from None
                self.split *= 2
                if (note := resource_limit_note(e)) is not None:
                    log(f"WARNING: step {step}: {note}")
                t, per = self.train, math.ceil(rows / self.split)
                if o.micro_key is not None:
                    log(
                        f"WARNING: step {step}: out of memory ({e}); going on with passes of at "
                        f"most {per} (the same update; {o.micro_key}: {per} starts there)"
                    )
                    continue
                log(
                    f"WARNING: step {step}: out of memory ({e}); going on with micro-batches of "
                    f"{per} and grad_accumulation "
                    f"{t.grad_accumulation * self.split} (the same "
                    f"{t.batch_size * t.grad_accumulation} examples per step)"
                )

    # ---------------------------------------------------------------- non-finite steps
    def nonfinite(
        self, step: int, loss: float, scale_used: float, scale_after: float, log, last_saved
    ):
        """Account for a step whose update was not applied: an overflow the loss scaler
        handles (logged by ``log(message, quiet=True)``), a skip the recipe allows (a warning),
        or the end of the run (``TrainingError`` naming ``last_saved()``, the checkpoint to go
        back to)."""
        p = self.precision
        self.skipped += 1
        what = (
            f"the loss became {loss}"
            if not math.isfinite(loss)
            else f"the gradients became non-finite (loss {loss:.4g})"
        )
        if self.scaling == "dynamic" and scale_used > p.min_scale:
            log(
                f"step {step}: gradients overflowed at loss scale {scale_used:g}; "
                f"update skipped, scale now {scale_after:g}",
                quiet=True,
            )
            return
        self.in_a_row += 1
        if p.nonfinite == "skip" and self.in_a_row <= p.max_skipped:
            log(
                f"WARNING: step {step}: {what}; update skipped "
                f"({self.in_a_row} in a row, at most {p.max_skipped})"
            )
            return
        in_a_row = f" ({self.in_a_row} steps in a row)" if self.in_a_row > 1 else ""
        raise TrainingError(
            f"step {step}: {what}{in_a_row}; the update was not applied and the run stops. "
            f"Last checkpoint: {last_saved()}. Try a lower optimizer.lr, optimizer.grad_clip, "
            "model.dtype: float32, or check the data; resuming with "
            "precision.nonfinite=skip steps over such batches"
        )

    @property
    def sharded(self) -> bool:
        """Whether the weights are divided among the ranks (fsdp or tensor): every forward
        is then a collective, which every rank must run."""
        return self.layout is not None

    def unshard(self) -> None:
        """The model whole again on every rank (a collective), before rank 0 exports it; the
        optimizer's moments go first (the run trains no more; its step count and learning
        rate stay)."""
        for o in getattr(self.optimizer, "optimizers", None) or [self.optimizer]:
            o.state = {k: v for k, v in o.state.items() if isinstance(v, mx.array)}
        if self.layout is fsdp:
            fsdp.unshard_blocks(self.model)
        elif self.layout is tensor:
            tensor.unshard_tensors(self.model)
