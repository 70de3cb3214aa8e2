"""Distillation: a student learns a teacher's next-token distributions (``objective.type:
distill``). The teacher is any model mlxtune loads (a folder, a GGUF file, a quantized
checkpoint, or quantized as it loads with ``teacher_bits``) with the student's vocabulary; it
never trains.

- ``offline``: on SFT data, the forward KL from the teacher to the student at each target token,
  over the teacher's ``top_k`` likeliest tokens and the rest of its mass as one bucket (``top_k:
  0``: the whole vocabulary), both at ``temperature`` t and scaled by t^2 (Hinton et al.), mixed
  with the label cross-entropy: ``alpha`` x KD + (1 - alpha) x CE. ``teacher_logits:
  precomputed`` computes the teacher's top-k of every training and validation example once,
  into the run directory (``teacher_topk.safetensors``, read back on resume), and keeps no
  teacher in memory while training.
- ``gkd`` (Agarwal et al., as TRL's GKDTrainer): the generalized Jensen-Shannon divergence with
  ``beta`` over the whole vocabulary (0: forward KL, 1: reverse KL), at ``temperature``. A share
  ``lmbda`` of the batches have their completions drawn from the student as it is (on-policy);
  with ``seq_kd`` the others from the teacher (sequence-level KD), else they are the data's.
- ``on_policy``: the student completes each prompt, and the loss is the reverse KL on its own
  tokens, estimated a token at a time: ``log q(x_t) - log p(x_t)``, whose gradient
  ``(log q - log p) x grad log q`` is a policy gradient with the teacher's log-prob as each
  token's reward. It needs each drawn token's log-prob under both models only: the loss kernel's
  per-token cross-entropy, never a [tokens, vocabulary] logits array.

Generated completions come from ``(train.seed, batch number)`` and the model as it is when the
batch is drawn, so a resumed run draws what the uninterrupted run drew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..config import ObjectiveConfig
from ..data import Batch, lengths_of, make_batch, read_positions
from ..data.batching import batch_order, eval_order
from ..errors import UserInputError
from ..generate import BLOCK, Sampling, eos_ids, generate_ids
from ..kernels import forward_only, linear_cross_entropy
from .base import IGNORE
from .online import OnPolicy, rollout_seed
from .sft import SFT
from .teacher import load_teacher

TEACHER_FILE = "teacher_topk.safetensors"


@dataclass
class StudentQuantization:
    """Learned quantization (as mlx-lm's DWQ): the student is the model quantized as it loads
    (affine, as mlx-lm's convert: every linear layer and the embedding whose width is whole
    groups), and what trains is its scales and biases; the codes stay. The teacher is
    typically the same model in full precision."""

    bits: int = 4
    """Bits per weight: 2, 3, 4, 5, 6 or 8."""
    group_size: int = 64
    """Weights per scale and bias: 32, 64 or 128."""


@dataclass
class DistillConfig(ObjectiveConfig):
    """Distillation from a teacher model with the student's vocabulary."""

    type: str = "distill"
    """This objective."""
    teacher: str = ""
    """The teacher: a model folder, a GGUF file, package:NAME/FILE or a Hub id (relative paths
    from the recipe's folder), with the student's tokenizer."""
    teacher_bits: int | None = None
    """Quantize the teacher to 4 or 8 bits (groups of 64) as it loads; null keeps it as stored
    (a quantized checkpoint or a GGUF file's quantized weights stay quantized)."""
    teacher_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the teacher's floating-point weights."""
    mode: Literal["offline", "gkd", "on_policy"] = "offline"
    """offline: KD on the data's completions; gkd: generalized JSD, on the data's, the
    student's (lmbda) or the teacher's (seq_kd) completions; on_policy: the reverse KL on the
    student's own completions."""
    teacher_logits: Literal["live", "precomputed"] = "live"
    """offline: live runs the teacher beside each step; precomputed keeps its top_k of every
    example from one pass before training, in the run directory (no teacher in memory after)."""
    top_k: int = 64
    """offline: the teacher's likeliest tokens kept at each position, the rest of its mass one
    bucket (0: the whole vocabulary)."""
    alpha: float = 0.5
    """offline: weight of the KD term; the label cross-entropy gets 1 - alpha."""
    temperature: float = 1.0
    """offline and gkd: both distributions' softmax temperature in the loss."""
    beta: float = 0.5
    """gkd: the generalized JSD's interpolation (0: forward KL(teacher || student), 1: reverse
    KL(student || teacher))."""
    lmbda: float = 0.5
    """gkd: the share of batches whose completions the student draws (on-policy)."""
    seq_kd: bool = False
    """gkd: the batches the student does not complete are completed by the teacher (sequence-
    level KD) instead of taken from the data."""
    max_completion_length: int = 64
    """gkd and on_policy: tokens a drawn completion may have."""
    generation_temperature: float = 1.0
    """gkd and on_policy: sampling temperature of drawn completions (0: greedy)."""
    student_quantization: StudentQuantization | None = None
    """Learned quantization: quantize the student (the model) as it loads and train its scales
    and biases to match the teacher (with the adapter section left out); its fused export is
    that quantized model (docs/quantization.md). null: the student trains as the adapter
    section says."""

    def checks(self) -> tuple:
        return (
            (bool(self.teacher), "teacher", "a model path"),
            (self.teacher_bits in (None, 4, 8), "teacher_bits", "4, 8 or null"),
            (self.top_k >= 0, "top_k", "at least 0"),
            (0 <= self.alpha <= 1, "alpha", "in [0, 1]"),
            (self.temperature > 0, "temperature", "greater than 0"),
            (0 <= self.beta <= 1, "beta", "in [0, 1]"),
            (0 <= self.lmbda <= 1, "lmbda", "in [0, 1]"),
            (self.max_completion_length >= 1, "max_completion_length", "at least 1"),
            (self.generation_temperature >= 0, "generation_temperature", "at least 0"),
            (
                self.teacher_logits == "live" or self.mode == "offline",
                "teacher_logits",
                "live outside mode offline (the teacher reads completions drawn as training goes)",
            ),
        )


def completions_read(cfg: DistillConfig) -> bool:
    """Whether the data's completions are trained on (else prompts are all it needs)."""
    if cfg.mode == "offline":
        return True
    return cfg.mode == "gkd" and cfg.lmbda < 1 and not cfg.seq_kd


@dataclass
class DistillBatch(Batch):
    """A batch with each row's example (``index`` into ``split``; -1: none) and where its
    completions come from (``source``: data, student or teacher)."""

    index: np.ndarray | None = None
    split: str = "train"
    source: str = "data"


def log_softmax(z: mx.array) -> mx.array:
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def _log1mexp(x: mx.array) -> mx.array:
    """log(1 - exp(x)) for x < 0, kept finite where x rounds to 0."""
    return mx.log(-mx.expm1(mx.minimum(x, -1e-7)))


def topk_kl(teacher_logp: mx.array, student_logp: mx.array) -> mx.array:
    """[N] forward KL over k tokens and the rest of the mass as one bucket: both arguments
    [N, k] log-probs of the same tokens (the teacher's likeliest), under full softmaxes."""
    p = mx.exp(teacher_logp)
    kl = mx.sum(p * (teacher_logp - student_logp), axis=-1)
    t_rest = _log1mexp(mx.logsumexp(teacher_logp, axis=-1))
    s_rest = _log1mexp(mx.logsumexp(student_logp, axis=-1))
    p_rest = mx.exp(t_rest)
    return kl + mx.where(p_rest > 1e-6, p_rest * (t_rest - s_rest), 0.0)


def generalized_jsd(student_logp: mx.array, teacher_logp: mx.array, beta: float) -> mx.array:
    """[N] GKD's divergence from [N, V] log-probs: beta KL(t || m) + (1 - beta) KL(s || m),
    m = beta t + (1 - beta) s; at beta 0 KL(t || s), at 1 KL(s || t)."""
    if beta == 0:
        return mx.sum(mx.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)
    if beta == 1:
        return mx.sum(mx.exp(student_logp) * (student_logp - teacher_logp), axis=-1)
    m = mx.logaddexp(student_logp + math.log(1 - beta), teacher_logp + math.log(beta))
    kt = mx.sum(mx.exp(teacher_logp) * (teacher_logp - m), axis=-1)
    ks = mx.sum(mx.exp(student_logp) * (student_logp - m), axis=-1)
    return beta * kt + (1 - beta) * ks


class Distill(SFT):
    """Distillation from a teacher (see the module's text), counted in target tokens."""

    name = "distill"
    Config = DistillConfig

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        cfg = self.config
        if self.packing != "off":
            raise UserInputError(
                "distillation batches one example a row: use packing: off", "data.packing"
            )
        if getattr(components.train_set, "streamed", False):
            raise UserInputError("distillation reads no stream: data.streaming: false", "data")
        self.mode = cfg.mode
        self.vocab = int(components.lm.head_weight().shape[0])
        if cfg.mode == "gkd" and completions_read(cfg):
            bare = next((e for e in components.train_set.examples if not e.prompt_ids), None)
            if bare is not None:
                raise UserInputError(
                    "gkd draws completions of the data's prompts: give completion, instruction "
                    "or chat rows (this one has no prompt)",
                    "data.train",
                )
        if not completions_read(cfg) and self.recipe.eval.exact_match:
            missing = next((e for e in components.test_set.examples if e.answer is None), None)
            if missing is not None:
                raise UserInputError(
                    "eval.exact_match compares with each row's 'answer'; this row has none",
                    getattr(missing, "where", "data.test"),
                )
        self.eos = eos_ids(components.tokenizer)
        self._eos_id = components.tokenizer.eos_token_id
        self.sampling = Sampling(cfg.generation_temperature)
        self.teacher = self.teacher_lm = None
        self._table: dict[str, dict[str, np.ndarray]] | None = None
        if cfg.teacher_logits == "live":
            self.teacher, self.teacher_lm = load_teacher(
                recipe, components.tokenizer, self.vocab, lambda _: None
            )
        self._teacher_bytes = (
            sum(v.nbytes for _, v in tree_flatten(self.teacher.parameters()))
            if self.teacher is not None
            else 0
        )
        self.k = cfg.top_k if 0 < cfg.top_k < self.vocab else 0

    # ------------------------------------------------------------------ data
    @classmethod
    def datasets(cls, recipe, tokenizer):
        """SFT examples where the data's completions are trained on; prompt rows otherwise."""
        if completions_read(recipe.objective):
            return super().datasets(recipe, tokenizer)
        return OnPolicy.datasets(recipe, tokenizer)

    def prepare(self, run_dir, source, log) -> None:
        cfg = self.config
        if self.teacher is not None:
            log(
                f"teacher: {cfg.teacher} ({self._teacher_bytes / 1e9:.3f} GB), run beside each step"
            )
        else:
            self._table = self._teacher_table(run_dir, source, log)

    def _source(self, g: int) -> str:
        """Where batch ``g``'s completions come from."""
        cfg = self.config
        if cfg.mode == "offline":
            return "data"
        if cfg.mode == "on_policy":
            return "student"
        if np.random.default_rng([self.recipe.train.seed, g, 1]).random() < cfg.lmbda:
            return "student"
        return "teacher" if cfg.seq_kd else "data"

    def batches(self, start_epoch: int = 0, skip: int = 0):
        r, t, c = self.recipe, self.recipe.train, self.components
        ds = c.train_set
        lengths = lengths_of(ds.examples)
        per = self.batches_per_epoch()
        epoch = start_epoch
        while True:
            order = batch_order(lengths, t.batch_size, epoch, t.seed, r.data.bucket_size)
            for i, idx in enumerate(order):
                if epoch == start_epoch and i < skip:
                    continue
                g = epoch * per + i
                yield epoch, self._batch(ds, idx, "train", self._source(g), rollout_seed(t.seed, g))
            epoch += 1

    def batches_per_epoch(self) -> int:
        return self.epoch_batches(len(self.components.train_set))

    def _batch(self, ds, idx, split: str, source: str, seed: int) -> DistillBatch:
        examples = [ds.examples[i] for i in idx]
        multiple = self.recipe.data.pad_to_multiple
        if source == "data":
            b = make_batch(examples, self.components.pad_id, multiple)
        else:
            b = self._completed(examples, source, seed)
        return DistillBatch(
            b.tokens, b.mask, b.n_targets, b.lengths, None, np.asarray(idx, np.int64), split, source
        )

    def _completed(self, examples, source: str, seed: int, sampling: Sampling | None = None):
        """A batch of the examples' prompts, each completed by the student or the teacher
        (EOS added where a completion ended), only the completions trained on."""
        cfg, c = self.config, self.components
        model = c.model if source == "student" else self.teacher
        prompts = [list(e.prompt_ids) for e in examples]
        keys = mx.random.split(mx.random.key(seed), len(prompts))
        new = generate_ids(
            model,
            prompts,
            cfg.max_completion_length,
            self.eos,
            sampling=sampling or self.sampling,
            keys=keys,
        )
        seqs, masks = [], []
        for p, n in zip(prompts, new, strict=True):
            ended = len(n) < cfg.max_completion_length and self._eos_id is not None
            comp = n + [self._eos_id] if ended else n
            seqs.append(p + comp)
            masks.append([0] * len(p) + [1] * len(comp))
        width = read_positions(max(len(s) for s in seqs), self.recipe.data.pad_to_multiple) + 1
        tokens = np.full((len(seqs), width), c.pad_id, np.int32)
        mask = np.zeros((len(seqs), width), np.int32)
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            tokens[i, : len(s)], mask[i, : len(m)] = s, m
        return Batch(tokens, mask, int(mask[:, 1:].sum()), tuple(len(s) for s in seqs))

    def split(self, batch: DistillBatch, parts: int) -> list[DistillBatch]:
        rows = len(batch.tokens)
        if parts <= 1 or rows <= 1:
            return [batch]
        size = math.ceil(rows / parts)
        return [self._rows(batch, slice(s, s + size)) for s in range(0, rows, size)]

    @staticmethod
    def _rows(b: DistillBatch, rows: slice) -> DistillBatch:
        mask = b.mask[rows]
        return DistillBatch(
            b.tokens[rows], mask, int(mask[:, 1:].sum()), b.lengths[rows], None,
            b.index[rows], b.split, b.source,
        )  # fmt: skip

    def nothing(self, batch: DistillBatch) -> DistillBatch:
        b = self._rows(batch, slice(0, 1))
        b.mask, b.n_targets, b.index = np.zeros_like(b.mask), 0, np.full(1, -1, np.int64)
        return b

    def host_metrics(self, batch: DistillBatch) -> dict:
        if self.mode != "gkd":
            return {}
        return {"on_policy": (float(batch.source == "student"), 1.0)}

    def layout(self) -> tuple[int, int]:
        if completions_read(self.config):
            rows, positions = super().layout()
            if self.mode == "offline":
                return rows, positions
        else:
            rows, positions = self.recipe.train.batch_size, 0
        longest = max(len(e.prompt_ids or e.ids) for e in self.components.train_set.examples)
        drawn = read_positions(longest + self.config.max_completion_length, 8)
        return rows, max(positions, drawn)

    def generation_layout(self) -> tuple[int, int] | None:
        if self.mode == "offline":
            return None
        rows, positions = self.layout()
        return rows, -(-positions // BLOCK) * BLOCK

    def reference_memory(self) -> dict:
        """The teacher's weights and its forward (live), and the [targets, vocabulary] logits
        the KD and JSD terms hold: both models', their softmaxes and the student's gradient."""
        rows, positions = self.layout()
        logits = 0 if self.mode == "on_policy" else rows * positions * self.vocab * 4 * 6
        live = self.teacher is not None
        return {"forward": live, "bytes": self._teacher_bytes, "step_bytes": logits}

    # ------------------------------------------------------------------ the teacher's top-k
    def _teacher_table(self, run_dir, source, log) -> dict[str, dict[str, np.ndarray]]:
        """Each split's teacher top-k at every target position, example by example (``offsets``
        [examples + 1] into ``ids`` and ``logp`` [positions, k]): read back from the run being
        resumed, or computed once here and written to the run directory."""
        c, cfg = self.components, self.config
        splits = {"train": c.train_set, "valid": c.valid_set}
        counts = {
            k: np.array([e.n_targets for e in ds.examples], np.int64) for k, ds in splits.items()
        }
        saved = source.path / TEACHER_FILE if source is not None else None
        if saved is not None and saved.exists():
            flat = {k: np.array(v) for k, v in mx.load(str(saved)).items()}
            table = {k: {n: flat[f"{k}.{n}"] for n in ("offsets", "ids", "logp")} for k in splits}
            for k, n in counts.items():
                if not np.array_equal(np.diff(table[k]["offsets"]), n):
                    raise UserInputError(
                        f"the teacher's top-k here is for other data ({k})", str(saved)
                    )
            log(f"teacher: top-k of every example, read from {TEACHER_FILE}")
            return table
        _, lm = load_teacher(self.recipe, c.tokenizer, self.vocab, log)
        k = self.k or self.vocab
        table = {}

        @mx.compile
        def top(tokens):
            h = lm.hidden(tokens[:, :-1])
            logp = log_softmax(lm.logits(h) / cfg.temperature)
            ids = mx.argpartition(-logp, k - 1, axis=-1)[..., :k]
            return ids.astype(mx.int32), mx.take_along_axis(logp, ids, axis=-1)

        size = self.eval_batch_size
        for name, ds in splits.items():
            offsets = np.concatenate([[0], np.cumsum(counts[name])])
            ids = np.zeros((offsets[-1], k), np.int32)
            logp = np.zeros((offsets[-1], k), np.float32)
            for idx in eval_order(lengths_of(ds.examples), size):
                b = make_batch([ds.examples[i] for i in idx], c.pad_id, 1)
                got_ids, got_logp = (np.array(x) for x in top(mx.array(b.tokens)))
                for r, i in enumerate(idx):
                    at = np.flatnonzero(b.mask[r, 1:] > 0)
                    ids[offsets[i] : offsets[i + 1]] = got_ids[r, at]
                    logp[offsets[i] : offsets[i + 1]] = got_logp[r, at]
            table[name] = {"offsets": offsets, "ids": ids, "logp": logp}
        mx.save_safetensors(
            str(run_dir.path / TEACHER_FILE),
            {f"{s}.{n}": mx.array(v) for s, t in table.items() for n, v in t.items()},
        )
        log(
            f"teacher: its top {k} of {sum(int(n.sum()) for n in counts.values())} target "
            f"tokens computed once ({TEACHER_FILE}); no teacher in memory while training"
        )
        return table

    def arrays(self, batch: DistillBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        if self._table is None:
            return out
        table = self._table[batch.split]
        width = batch.tokens.shape[1] - 1
        k = table["ids"].shape[1]
        ids = np.zeros((len(batch.tokens) * width, k), np.int32)
        logp = np.zeros((len(batch.tokens) * width, k), np.float32)
        for r, i in enumerate(batch.index):
            if i < 0:
                continue
            at = r * width + np.flatnonzero(batch.mask[r, 1:] > 0)
            a, e = table["offsets"][i], table["offsets"][i + 1]
            ids[at], logp[at] = table["ids"][a:e], table["logp"][a:e]
        out["teacher_ids"], out["teacher_logp"] = ids, logp
        return out

    # ------------------------------------------------------------------ the loss
    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        tokens, mask = batch["tokens"], batch["mask"]
        on = (mask[:, 1:] > 0).reshape(-1)
        labels = tokens[:, 1:].reshape(-1)
        h = self.hidden(batch)
        flat = h.reshape(-1, h.shape[-1])
        rows = batch.get("rows")
        if rows is not None:
            flat, on, labels = flat[rows], on[rows], labels[rows]
        on = on.astype(mx.float32)
        n = mx.sum(on).astype(mx.int32)
        if self.mode == "on_policy":
            return self._reverse_kl(batch, h, n)
        lm, t = self.components.lm, self.config.temperature
        z = lm.logits(flat)
        if self.mode == "gkd":
            s = log_softmax(z / t)
            jsd = generalized_jsd(
                s, log_softmax(self._teacher_logits(batch, rows) / t), self.config.beta
            )
            return mx.sum(jsd * on), n, {}
        # offline: KD on the teacher's top-k (or every token) + the labels' cross-entropy
        if self._table is not None:
            ids, tl = batch["teacher_ids"], batch["teacher_logp"]
            if rows is not None:
                ids, tl = ids[rows], tl[rows]
        else:
            tl = log_softmax(self._teacher_logits(batch, rows) / t)
            ids = mx.argpartition(-tl, self.k - 1, axis=-1)[:, : self.k] if self.k else None
            tl = tl if ids is None else mx.take_along_axis(tl, ids, axis=-1)
        s = log_softmax(z / t)
        if ids is None:
            kd = mx.sum(mx.exp(tl) * (tl - s), axis=-1)
        else:
            kd = topk_kl(tl, mx.take_along_axis(s, ids, axis=-1))
        ce = mx.logsumexp(z, axis=-1) - mx.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
        a = self.config.alpha
        per = a * t * t * kd + (1 - a) * ce
        metrics = {
            "kd_loss": mx.stop_gradient(mx.sum(kd * on)),
            "ce_loss": mx.stop_gradient(mx.sum(ce * on)),
        }
        return mx.sum(per * on), n, metrics

    def _teacher_logits(self, batch, rows) -> mx.array:
        """[positions, V] the teacher's fp32 logits where the student's loss reads them."""
        with forward_only():
            ht = self.teacher_lm.hidden(batch["tokens"][:, :-1])
            ht = ht.reshape(-1, ht.shape[-1])
            out = self.teacher_lm.logits(ht if rows is None else ht[rows])
        return mx.stop_gradient(out)

    def _reverse_kl(self, batch, h, n):
        """on_policy: sum over drawn tokens of log q - log p; its gradient (log q - log p) x
        grad log q."""
        c = self.components
        tok, _ = self.token_losses(batch, reduction="none", hidden=h)
        logq = -tok.reshape(-1)
        tokens, mask = batch["tokens"], batch["mask"]
        targets = mx.where(mask[:, 1:] > 0, tokens[:, 1:], IGNORE).reshape(-1)
        with forward_only():
            ht = self.teacher_lm.hidden(tokens[:, :-1])
            lt = self.teacher_lm
            per, _ = linear_cross_entropy(
                lt.loss_hidden(ht.reshape(-1, ht.shape[-1])),
                lt.head_rows(),
                targets,
                ignore_index=IGNORE,
                softcap=lt.softcap,
                reduction="none",
                impl=c.tiers["loss"],
                weight_grad=False,
            )
        logp = mx.stop_gradient(-per)
        on = (mask[:, 1:] > 0).reshape(-1).astype(mx.float32)
        d = mx.stop_gradient(logq) - logp
        # the value is the estimate d; the gradient d x grad log q
        surrogate = d * (logq - mx.stop_gradient(logq)) + d
        return mx.sum(surrogate * on), n, {"teacher_logps": mx.sum(logp * on)}

    # ------------------------------------------------------------------ evaluation
    def eval_batches(self):
        """The validation examples as the data gives them, or, for prompt rows, completed by
        the student greedily (the loss then says how far its own answers are from the
        teacher's judgement)."""
        r, c = self.recipe, self.components
        ds = c.valid_set
        size = self.eval_batch_size
        order = eval_order(lengths_of(ds.examples), size, r.eval.max_batches)
        source = "data" if completions_read(self.config) else "student"
        greedy = Sampling(0.0)
        out = []
        for j, idx in enumerate(order):
            examples = [ds.examples[i] for i in idx]
            if source == "data":
                b = make_batch(examples, c.pad_id, r.data.pad_to_multiple)
            else:
                b = self._completed(examples, "student", rollout_seed(r.train.seed, j), greedy)
            out.append(
                DistillBatch(
                    b.tokens,
                    b.mask,
                    b.n_targets,
                    b.lengths,
                    None,
                    np.asarray(idx, np.int64),
                    "valid",
                    source,
                )  # fmt: skip
            )
        return out

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict[str, float]) -> dict:
        n = max(count, 1)
        out = {"eval_loss": loss_sum / n, "eval_tokens": count}
        out.update({f"eval_{k}": v / n for k, v in metrics.items()})
        return out


__all__ = ["Distill", "DistillBatch", "DistillConfig", "generalized_jsd", "topk_kl"]
