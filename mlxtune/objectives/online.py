"""What the on-policy objectives (GRPO, PPO, online DPO) share: prompts completed by the policy
as it is and scored by reward functions (or, offline, groups given with their rewards), the
endless stream of rollouts a run trains on, the passes a rollout's rows are cut into, rollouts
kept in checkpoints, and the held-out reward.

A rollout is the prompts of one optimizer step (``train.batch_size`` x
``train.grad_accumulation``); it trains ``num_iterations`` steps, and a checkpoint taken between
them keeps it (``rollout.safetensors``), so a resumed run trains on the same completions.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import mlx.core as mx
import numpy as np

from ..config import ObjectiveConfig
from ..data import BadRows, held_out, read_positions
from ..data.cache import cached_split
from ..data.prompts import PromptEncoder, PromptExample, load_prompts
from ..distributed import current
from ..errors import UserInputError
from ..generate import BLOCK, Sampling, StopStrings, decode_answer, eos_ids, generate_ids
from ..rewards import RewardSpec, build_rewards, score
from .agentic import recipe_tools
from .base import Objective, Usage
from .held_out import HeldOutReward
from .reference import ReferencePolicy, reference_kind
from .rollout import (
    RolloutBatch,
    cut_rows,
    even_sizes,
    gather_completions,
    gather_floats,
    handed_again,
    load_rollout,
    reward_means,
    rollout_seed,
    rows_of,
    save_rollout,
)

ROLLOUT_FILE = "rollout.safetensors"
MICRO_POSITIONS = 1024
"""Positions a training pass holds by default (``micro_batch_size: null``): enough rows to keep a
GPU's matmuls full for the models people tune on a Mac, few enough that a pass's activations
stay a small share of the step's memory."""


@dataclass
class RLConfig(ObjectiveConfig):
    """What the reinforcement-learning objectives share: prompts completed by the policy,
    scored by reward functions."""

    type: str = "grpo"
    """This objective."""
    num_generations: int = 8
    """Completions drawn for each prompt (a group: GRPO's advantages compare within it)."""
    max_completion_length: int = 256
    """Tokens a completion may have; one cut there did not end (frac_truncated)."""
    temperature: float = 1.0
    """Sampling temperature of the completions (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    top_k: int = 0
    """Only the top_k likeliest tokens (0: all)."""
    min_p: float = 0.0
    """Only tokens at least min_p x the likeliest one's probability."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion (kept in it; e.g. "</answer>"): such a completion ended,
    with no EOS after it."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length train on nothing."""
    reference: Literal["auto", "copy"] = "auto"
    """The reference policy of the KL term: auto (LoRA/DoRA: the base with adapters off; full:
    copy), copy (the trainable weights as the run starts)."""
    rewards: list[RewardSpec] = field(default_factory=list)
    """The reward functions and their weights."""
    eval_temperature: float = 0.0
    """Held-out evaluation: one completion a prompt at this temperature (0: greedy)."""
    micro_batch_size: int | None = None
    """Completions a training pass holds (a forward and a backward each; the step's gradients
    add up over its passes, so the update is the same whatever the size): the main lever on a
    step's peak memory. Null: as many as fill about 1,024 positions (prompt and completion
    padded; at least one)."""

    def checks(self) -> tuple:
        m = self.micro_batch_size
        return (
            (self.num_generations >= 1, "num_generations", "at least 1"),
            (self.max_completion_length >= 1, "max_completion_length", "at least 1"),
            (self.temperature > 0, "temperature", "greater than 0"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.top_k >= 0, "top_k", "at least 0"),
            (0 <= self.min_p < 1, "min_p", "in [0, 1)"),
            (self.eval_temperature >= 0, "eval_temperature", "at least 0"),
            (m is None or m >= 1, "micro_batch_size", "at least 1"),
        )


class OnPolicy(HeldOutReward, Objective):
    """Prompt rows completed by the policy (or given groups), scored, and trained on in
    rollouts; the loss and what a rollout's rows carry besides are the subclass's."""

    Config = RLConfig
    noun = "prompts"
    micro_key = "objective.micro_batch_size"
    offline_refusal: str | None = None
    """Why the objective takes no offline rows (given responses and rewards), where it takes
    none."""

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        cfg, d = self.config, recipe.data
        if d.packing != "off":
            raise UserInputError(
                f"objective.type {self.name} trains on generated completions, one a row: use "
                "packing: off",
                "data.packing",
            )
        self.offline = components.train_set.examples[0].responses is not None
        if self.offline and self.offline_refusal:
            raise UserInputError(self.offline_refusal, str(components.train_set.path))
        self.rewards = build_rewards(cfg.rewards, recipe)
        if not self.offline:
            if not self.rewards and not self._other_rewards():
                raise UserInputError(
                    f"objective.type {self.name} scores its completions with reward functions: "
                    "name at least one (e.g. [{name: exact_match}])",
                    "objective.rewards",
                )
        wants_answer = any(s.name == "exact_match" for s in cfg.rewards)
        if wants_answer:  # the sets the functions score: offline groups come with rewards
            scored = [components.valid_set] if self.offline else [components.train_set]
            for ds in scored + ([] if self.offline else [components.valid_set]):
                missing = next((e for e in ds.examples if e.answer is None), None)
                if missing is not None:
                    raise UserInputError(
                        "the exact_match reward compares with each row's 'answer'; this row has "
                        "none",
                        missing.where,
                    )
        self.sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
        self.stop = StopStrings(components.tokenizer, cfg.stop) if cfg.stop else None
        self._reference = (
            ReferencePolicy(reference_kind(cfg.reference, recipe.adapter.type), components.model)
            if self._kl_weight() > 0
            else None
        )
        # offline groups come from some other policy: the model as the run starts stands for
        # it, so that the clip keeps each token's probability within epsilon of where it began
        # (fixed samples with negative advantages would otherwise be pushed down without end)
        self._behaviour = ReferencePolicy("copy", components.model) if self.offline else None
        self.eos = eos_ids(components.tokenizer)
        self._eos_id = components.tokenizer.eos_token_id
        if self._eos_id is None and not self.offline:
            raise UserInputError("the tokenizer has no EOS token to end completions", "tokenizer")
        self._rollout: tuple[int, list[RolloutBatch]] | None = None
        self._used = 0
        """Batches of the current rollout handed out (to save it when a checkpoint falls
        inside it)."""
        self._restored: tuple[int, int, list[RolloutBatch]] | None = None
        self.eval_samples: list[dict] = []

    # the hooks the objective answers
    def _kl_weight(self) -> float:
        """The KL term's weight (0: no reference policy)."""
        return 0.0

    def _other_rewards(self) -> bool:
        """Whether something besides the reward functions scores completions."""
        return False

    def _labels(self) -> list[str]:
        """The names of what scores completions (``rewards/<name>`` in rows)."""
        return [x.label for x in self.rewards]

    # ------------------------------------------------------------------ data
    @classmethod
    def datasets(cls, recipe, tokenizer):
        """(train, valid, test) prompt rows; valid is split off train when not named."""
        r, d, cfg = recipe, recipe.data, recipe.objective
        tools = recipe_tools(recipe)[1] if getattr(cfg, "tools", None) else None
        enc = PromptEncoder(tokenizer, d.add_eos, d.chat_template_kwargs, tools)

        def load(path):
            source, limits = r.resolve_path(path), (d.max_length, cfg.max_completion_length)
            bad = BadRows(d.bad_rows == "skip", d.max_bad_fraction)
            build = partial(
                load_prompts, source, enc, *limits, d.overlong, d.columns, bad, d.num_proc
            )
            return cached_split(source, d, tokenizer, enc, build, (PromptExample,), limits=limits)

        train = load(d.train)
        train, valid, test = held_out(train, d, r.train.seed, bool(d.valid), bool(d.test))
        if valid is None:
            valid = load(d.valid)
        if test is None:
            test = load(d.test) if d.test else valid
        for ds in (train, valid, test):
            ds.stats.noun = "prompts"
        return train, valid, test

    def _prompts_per_epoch(self) -> int:
        return self.epoch_batches(len(self.components.train_set))

    def batches_per_epoch(self) -> int:
        return self._prompts_per_epoch() * self._yields() // self._batches_per_rollout()

    def _batches_per_rollout(self) -> int:
        """Prompt batches a rollout takes: one optimizer step's (grad_accumulation)."""
        return self.recipe.train.grad_accumulation

    def _yields(self) -> int:
        """Batches a rollout hands out: its micro-batches, num_iterations times."""
        return self.recipe.train.grad_accumulation * self.config.num_iterations

    def _hand_out(self, rollout: list[RolloutBatch], j: int) -> RolloutBatch:
        """The ``j``-th batch a rollout hands out."""
        a = len(rollout)
        # a later iteration: the same rows, counted once already
        return rollout[j % a] if j < a else handed_again(rollout[j % a])

    def _prompt_batch(self, g: int) -> list[PromptExample]:
        """Batch ``g`` of the endless prompt stream (epochs of seeded shuffles)."""
        per, b = self._prompts_per_epoch(), self.recipe.train.batch_size
        epoch, i = divmod(g, per)
        ds = self.components.train_set
        order = np.random.default_rng([self.recipe.train.seed, epoch]).permutation(len(ds))
        return [ds.examples[j] for j in order[i * b : (i + 1) * b]]

    def batches(self, start_epoch: int = 0, skip: int = 0):
        """Rollout k holds prompt batches k x A .. k x A + A - 1 (A: ``_batches_per_rollout``)
        and hands out ``_yields`` batches; its epoch is its first prompt batch's."""
        a, each = self._batches_per_rollout(), self._yields()
        per = self._prompts_per_epoch()
        k = -(-start_epoch * per // a) + skip // each
        within = skip % each
        while True:
            if within:
                restored = self._restored
                if restored is None or restored[0] != k or restored[1] != within:
                    raise UserInputError(
                        "this checkpoint was saved inside a rollout but holds no "
                        f"{ROLLOUT_FILE} for it",
                        "--resume",
                    )
                rollout = restored[2]
            else:
                rollout = self.rollout(k)
            self._restored = None
            self._rollout, self._used = (k, rollout), within
            epoch = k * a // per
            for j in range(within, each):
                self._used = j + 1
                yield epoch, self._hand_out(rollout, j)
            within = 0
            k += 1

    # ------------------------------------------------------------------ rollouts
    def rollout(self, k: int) -> list[RolloutBatch]:
        """The grad_accumulation batches of rollout ``k``, generated (online) or read (offline)
        and scored under the model as it is now."""
        a = self._batches_per_rollout()
        out = []
        for j in range(a):
            prompts = self._prompt_batch(k * a + j)
            out.append(self.make_batch(prompts, rollout_seed(self.recipe.train.seed, k * a + j)))
        return out

    def make_batch(self, prompts: list[PromptExample], seed: int) -> RolloutBatch:
        """One batch of a rollout: ``prompts``' completions (``complete``), with what the
        objective's loss reads beside them."""
        raise NotImplementedError(f"{type(self).__name__} must define make_batch()")

    def complete(self, prompts: list[PromptExample], seed: int, logps: list | None = None):
        """(completions' token ids, whether each ended, group sizes, rewards, host metrics):
        generated with ``seed`` and scored by the reward functions, or (offline) as given.
        ``logps`` (online) gets each completion's tokens' log-probabilities as they were drawn
        (``generate_ids``)."""
        cfg, c = self.config, self.components
        model = c.model
        host: dict = {}
        if self.offline:
            ids = [r for p in prompts for r in p.responses]
            ended = [e for p in prompts for e in p.ended]
            groups = [len(p.responses) for p in prompts]
            rewards = np.array([r for p in prompts for r in p.rewards], np.float64)
        else:
            mx.eval(model.parameters())  # the queued step, before the clock starts
            t0 = time.perf_counter()
            g = cfg.num_generations
            keys = mx.random.split(mx.random.key(seed), len(prompts) * g)
            world = current()
            drawn = [] if logps is not None else None
            # data-parallel: each rank completes its share of the prompts (a row draws from its
            # own key, whatever it is batched with), then every rank gathers them all
            share = np.array_split(np.arange(len(prompts)), world.size)[world.rank]
            rows = (share[:, None] * g + np.arange(g)).reshape(-1)
            new = generate_ids(
                model,
                [prompts[i].prompt_ids for i in share],
                cfg.max_completion_length,
                self.eos,
                sampling=self.sampling,
                group=g,
                keys=keys[mx.array(rows)] if world.size > 1 else keys,
                stop=self.stop,
                logps=drawn,
            )
            if world.size > 1:
                width, n = cfg.max_completion_length, len(prompts) * g
                new = gather_completions(world, new, n, rows, width)
                if logps is not None:
                    drawn = gather_floats(world, drawn, n, rows, width + 1)
            if logps is not None:
                logps += drawn
            took = time.perf_counter() - t0
            # a completion ended at EOS (added back to train on), at a stop string, or was cut
            stopped = [self.stop is not None and self.stop.ends(n) for n in new]
            eos_end = [
                len(n) < cfg.max_completion_length and not st
                for n, st in zip(new, stopped, strict=True)
            ]
            ended = [a or b for a, b in zip(eos_end, stopped, strict=True)]
            ids = [n + [self._eos_id] if e else n for n, e in zip(new, eos_end, strict=True)]
            groups = [g] * len(prompts)
            made = sum(len(n) for n in new)
            host["generation_s"] = (took, self._steps_per_rollout() / self._batches_per_rollout())
            host["generation_tokens_per_sec"] = (made, took)
            rewards, each = self._score(prompts, groups, new)
            reward_means(host, each)
        self._group_metrics(host, ids, ended, groups, rewards)
        return ids, ended, groups, rewards, host

    def _group_metrics(self, host: dict, ids, ended, groups, rewards) -> None:
        """The rollout's reward, spread and length metrics, into ``host``."""
        n = len(ids)
        host["reward"] = (float(rewards.sum()), n)
        stds, at = [], 0
        for g in groups:
            stds.append(rewards[at : at + g].std(ddof=1) if g > 1 else 0.0)
            at += g
        host["reward_std"] = (float(np.sum(stds)), len(groups))
        host["frac_reward_zero_std"] = (float(sum(s < 1e-12 for s in stds)), len(groups))
        lengths = [len(x) for x in ids]
        host["completion_length"] = (float(sum(lengths)), n)
        host["completion_length_max"] = (float(max(lengths)), 1)
        host["frac_truncated"] = (float(sum(not e for e in ended)), n)

    def _steps_per_rollout(self) -> float:
        """Optimizer steps a rollout trains (how generation time is shared out over steps)."""
        return self.config.num_iterations

    def _score(self, prompts, groups, new) -> tuple[np.ndarray, dict]:
        tok = self.components.tokenizer
        rows = [p for p, g in zip(prompts, groups, strict=True) for _ in range(g)]
        texts = [decode_answer(tok, x) for x in new]
        total, each = score(
            self.rewards,
            [p.prompt for p in rows],
            texts,
            [list(x) for x in new],
            [{"answer": p.answer, **p.fields} for p in rows],
        )
        return np.array(total, np.float64), each

    def _rows(self, prompts, groups, ids, ended, adv, written=None, read=None) -> RolloutBatch:
        """The completions as rows after their prompts (``read``: each row's own prompt, where
        an environment gave it); ``written`` marks the completion tokens the model wrote (the
        others are context, never targets)."""
        cfg = self.config
        seqs, masks = [], []
        r = 0
        for p, g in zip(prompts, groups, strict=True):
            for _ in range(g):
                comp, head = ids[r], p.prompt_ids if read is None else read[r]
                seqs.append(head + comp)
                train = int(ended[r] or not cfg.mask_truncated_completions)
                own = [1] * len(comp) if written is None else written[r]
                masks.append([0] * len(head) + [train * w for w in own])
                r += 1
        width = read_positions(max(len(s) for s in seqs), self._multiple()) + 1
        tokens = np.full((len(seqs), width), self.components.pad_id, np.int32)
        mask = np.zeros((len(seqs), width), np.int32)
        for i, (s, m) in enumerate(zip(seqs, masks, strict=True)):
            tokens[i, : len(s)], mask[i, : len(m)] = s, m
        return RolloutBatch(
            tokens,
            mask,
            int(mask[:, 1:].sum()),
            tuple(len(s) for s in seqs),
            advantages=adv,
            valid=np.ones(len(seqs), np.float32),
            groups=tuple(groups),
            prompts=len(prompts),
        )

    def _multiple(self) -> int:
        return max(self.recipe.data.pad_to_multiple, 8)

    def _passes(self, batch: RolloutBatch, fn) -> list[np.ndarray]:
        """``fn(arrays)``, a tuple of [rows, ...] arrays made without gradients, over the rows
        of the batch's training passes (so a rollout's extra forwards peak no higher than its
        training), joined."""
        model = self.components.model
        was = model.training
        model.eval()
        try:
            outs = []
            for part in self.micro(batch):
                arrays = {k: mx.array(v) for k, v in Objective.arrays(self, part).items()}
                got = fn(arrays)
                mx.eval(got)
                outs.append([np.array(x.astype(mx.float32)) for x in got])
        finally:
            model.train(was)
        return [np.concatenate(xs) for xs in zip(*outs, strict=True)]

    def _target_logps(self, arrays) -> tuple[mx.array]:
        """(each target token's log-probability under the model as it is,) for ``_passes``."""
        tok, _ = self.token_losses(arrays, reduction="none")
        return (-tok,)

    def prepare(self, run_dir, source, log) -> None:
        ranks = current().size
        if ranks > 1 and not self.offline:
            log(
                f"generation: each of the {ranks} ranks completes its share of a step's prompts, "
                "then every rank gathers all the completions"
            )
        if self._reference is not None:
            self._reference.keep(log)
        if self._behaviour is not None:
            self._behaviour.keep(lambda _: None)
            log(
                "offline groups: the ratio's old policy is the model as the run starts (a copy "
                "of its trainable weights)"
            )
        if self.offline:  # keys the given groups leave unread
            unread = [
                f"objective.{k}"
                for k in ("num_generations", "temperature")
                if f"objective.{k}" in self.recipe.explicit
            ]
            if unread:
                log(
                    f"note: {' and '.join(unread)} have no effect here: the training groups "
                    "are given (offline rows with responses and rewards)"
                )

    def usage(self, batch: RolloutBatch) -> Usage:
        return Usage(batch.prompts, batch.n_targets, batch.n_tokens, batch.tokens.size)

    def host_metrics(self, batch: RolloutBatch) -> dict:
        return batch.host

    def micro_rows(self, positions: int) -> int:
        """Completions a training pass holds at ``positions`` a row."""
        m = self.config.micro_batch_size
        return m if m is not None else max(1, MICRO_POSITIONS // max(positions, 1))

    def micro(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """Passes of ``micro_rows`` completions at most, as even as they come (rows of one
        group may fall in different passes: every completion's loss is its own)."""
        rows = len(batch.tokens)
        per = self.micro_rows(batch.tokens.shape[1] - 1)
        return [batch] if rows <= per else cut_rows(batch, even_sizes(rows, -(-rows // per)))

    def split(self, batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
        """Parts of whole groups; of rows where there are fewer groups than parts."""
        groups, rows = batch.groups, len(batch.tokens)
        if parts <= 1 or rows <= 1:
            return [batch]
        if parts <= len(groups):
            size = math.ceil(len(groups) / parts)
            sizes = [sum(groups[s : s + size]) for s in range(0, len(groups), size)]
        else:
            sizes = even_sizes(rows, min(parts, rows))
        return cut_rows(batch, sizes)

    def units(self, batch: RolloutBatch) -> int:
        return len(batch.tokens)

    def nothing(self, batch: RolloutBatch) -> RolloutBatch:
        b = rows_of(batch, slice(0, 1), (1,), 0, False)
        b.mask = np.zeros_like(b.mask)
        b.n_targets = 0
        b.valid = np.zeros(1, np.float32)
        b.advantages = np.zeros(1, np.float32)
        return b

    def _batch_rows(self) -> int:
        """Completions in a batch handed to a step: batch_size x num_generations (offline:
        x the most responses a row has)."""
        r = self.recipe
        if self.offline:
            return r.train.batch_size * max(
                len(e.responses) for e in self.components.train_set.examples
            )
        return r.train.batch_size * self.config.num_generations

    def _positions(self) -> int:
        longest = max(len(e.prompt_ids) for e in self.components.train_set.examples)
        return read_positions(longest + self.config.max_completion_length, self._multiple())

    def layout(self) -> tuple[int, int]:
        """A training pass: the batch's completions up to ``micro_rows``, each the longest
        prompt and a whole completion."""
        positions, rows = self._positions(), self._batch_rows()
        per = min(rows, self.micro_rows(positions))
        return -(-rows // -(-rows // per)), positions  # the largest of micro's even passes

    def generation_layout(self) -> tuple[int, int] | None:
        """(rows, cache capacity) generated at once: a batch's completions, room for the
        longest prompt and a whole completion each (the cache grows ``BLOCK`` positions at a
        time); None offline."""
        if self.offline:
            return None
        return self._batch_rows(), -(-self._positions() // BLOCK) * BLOCK

    def generates(self) -> bool:
        """Rollouts while training, or, offline, the held-out reward's completions."""
        return super().generates() or bool(self.rewards or self._other_rewards())

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder) -> None:
        """The rollout being trained on, when the checkpoint falls inside it."""
        if self._rollout is None:
            return
        k, batches = self._rollout
        if self._used in (0, self._yields()):
            return
        save_rollout(folder / ROLLOUT_FILE, batches, {"rollout": str(k), "used": str(self._used)})

    def restore(self, folder) -> None:
        path = folder / ROLLOUT_FILE
        if not path.exists():
            return
        batches, meta = load_rollout(path, self._batches_per_rollout())
        self._restored = (int(meta["rollout"]), int(meta["used"]), batches)

    def eval_batches(self):
        """Offline validation groups (with their data's rewards), for the loss."""
        size = self.eval_batch_size
        examples = self.components.valid_set.examples
        batches = [examples[i : i + size] for i in range(0, len(examples), size)]
        return [self.make_batch(b, 0) for b in batches[: self.recipe.eval.max_batches or None]]


__all__ = ["MICRO_POSITIONS", "OnPolicy", "RLConfig", "ROLLOUT_FILE", "rollout_seed"]
