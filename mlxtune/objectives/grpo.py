"""GRPO: group relative policy optimisation, with the variants TRL names (the losses grpo, dr_grpo
and dapo, DAPO's asymmetric clip, GSPO's sequence-level importance ratio), online or offline.

Online, each step's prompts are completed ``num_generations`` times by the policy as it is (the
generation engine: one prefill a prompt, its cache shared by the group), the completions are
scored by the recipe's reward functions, and each completion's advantage is its reward against
its group's mean (scaled by the group's or the batch's standard deviation). Offline, the groups
and their rewards come with the data. The loss, per completion token, is

    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(q - p) - (q - p) - 1)

with ``r = exp(p - p_old)`` (``p`` the token's log-probability under the policy, its prompt in
context; ``importance_sampling: sequence`` uses the completion's mean log-ratio for every token)
and the k3 estimate of the KL to the reference policy ``q`` when ``beta > 0``. ``p_old`` is the
policy that generated the completions: the same weights on the first of ``num_iterations``
updates (r = 1, gradients of r A = the policy gradient), kept from generation for the rest.
Offline, where another policy wrote the completions, the model as the run starts stands for it
(its log-probs from a copy of the starting trainable weights): the clip then keeps every given
token's probability within epsilon of where it began, where fixed completions with negative
advantages would otherwise be pushed down without end. ``entropy_mask`` (TRL's
top_entropy_quantile) keeps the policy term of a batch's highest-entropy completion tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..data import read_positions
from ..data.prompts import PromptExample
from ..errors import UserInputError
from ..kernels import forward_only
from ..models import VisionLM
from ..tensor import vocab_split
from .agentic import Agent, rollouts, score_talks, transcript_text
from .filtering import Draw, filtered
from .online import OnPolicy, RLConfig
from .rollout import RolloutBatch, advantages

TOKEN_MEAN = ("dapo", "cispo")
"""The loss types that sum over every completion token of a step and divide by their number."""


@dataclass
class GRPOConfig(RLConfig):
    """Group relative policy optimisation on prompts, with rewards from functions (online) or
    from the data (offline rows with responses and rewards)."""

    type: str = "grpo"
    """This objective."""
    epsilon: float = 0.2
    """Clip range below 1 of the importance ratio (and above, unless epsilon_high)."""
    epsilon_high: float | None = None
    """Clip range above 1 (DAPO's clip-higher: e.g. 0.28); default epsilon."""
    beta: float = 0.0
    """Weight of the KL to the reference policy (k3 estimator); 0: no reference pass."""
    loss: Literal["grpo", "dr_grpo", "dapo", "cispo", "sapo"] = "dapo"
    """Normalisation: dapo (sum over every completion token of the step / their number), grpo
    (each completion's token mean, averaged over completions), dr_grpo (token sum /
    (completions x max_completion_length)); cispo (the importance ratio capped at epsilon_high
    and detached, times A and the token's log-probability; dapo's normalisation) and sapo (a
    soft clip, sigmoid(tau (r - 1)) x 4 / tau, tau by the advantage's sign; grpo's), as TRL
    defines them."""
    sapo_temperature_pos: float = 1.0
    """sapo: tau for tokens of a positive advantage."""
    sapo_temperature_neg: float = 1.05
    """sapo: tau for tokens of a non-positive advantage."""
    importance_sampling: Literal["token", "sequence"] = "token"
    """token: a ratio per token; sequence (GSPO): the completion's mean log-ratio."""
    importance_sampling_correction: Literal["none", "token", "sequence"] = "none"
    """Weight each token's policy term by exp(p_old - p_sampled), the trainer's log-prob of the
    token at the rollout over the log-prob it was drawn with (token: each token's; sequence:
    the completion's summed log-ratio), truncated at importance_sampling_cap (truncated
    importance sampling: where generation's numbers differ from training's)."""
    importance_sampling_cap: float = 3.0
    """The largest importance weight (the weights are truncated there)."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (no advantage to
    learn from) and draw more prompts until the batch holds batch_size groups again, within
    filter_max_draws."""
    filter_max_draws: int = 4
    """filter_groups: prompt batches drawn for one batch at most, the first included (a batch
    still short then trains on the groups it has)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide advantages by the group's reward standard deviation, the whole batch's, or not."""
    num_iterations: int = 1
    """Optimizer steps each rollout trains (> 1 keeps the generating policy's log-probs)."""
    tools: list[str] = field(default_factory=list)
    """Multi-turn rollouts: FILE.py:FUNCTION tools (a file relative to the recipe) the chat
    template shows the model and its tool calls run."""
    environment: str | None = None
    """Multi-turn rollouts: FILE.py:CLASS, one instance a conversation: reset(row) -> first
    messages or None, step(assistant message) -> (messages, done, reward)."""
    max_turns: int = 4
    """Multi-turn rollouts: the model's turns in a conversation, at most."""
    max_rollout_length: int | None = None
    """Multi-turn rollouts: tokens after the prompt, the model's and the tools' (default
    max_turns x max_completion_length, which caps each of the model's turns)."""
    tool_timeout_s: float = 10.0
    """Multi-turn rollouts: seconds a tool call may take; then the model reads an error."""
    tool_format: Literal["auto", "hermes", "llama3", "mistral"] = "auto"
    """How tool calls are written: auto (as the chat template shows), hermes (<tool_call>
    JSON), llama3 (a JSON object), mistral ([TOOL_CALLS])."""
    entropy_mask: float | None = None
    """Train on the highest-entropy tokens only: the top fraction of a batch's completion tokens
    by the policy's entropy at each keeps its policy term (0.2: the top fifth, as TRL's
    top_entropy_quantile 0.2); null or 1.0: every token."""

    def checks(self) -> tuple:
        return super().checks() + (
            (0 <= self.epsilon < 1, "epsilon", "in [0, 1)"),
            (self.epsilon_high is None or self.epsilon_high >= 0, "epsilon_high", "at least 0"),
            (
                self.loss != "cispo" or self.epsilon_high is not None,
                "epsilon_high",
                "set with loss cispo (the cap on the importance ratio, the ScaleRL paper's "
                "epsilon_max: 5.0 recommended)",
            ),
            (self.sapo_temperature_pos > 0, "sapo_temperature_pos", "greater than 0"),
            (self.sapo_temperature_neg > 0, "sapo_temperature_neg", "greater than 0"),
            (self.beta >= 0, "beta", "at least 0"),
            (self.num_iterations >= 1, "num_iterations", "at least 1"),
            (
                self.entropy_mask is None or 0 < self.entropy_mask <= 1,
                "entropy_mask",
                "in (0, 1]: the top fraction of completion tokens by entropy that train (null: all)",
            ),
            (self.max_turns >= 1, "max_turns", "at least 1"),
            (
                self.max_rollout_length is None or self.max_rollout_length >= 1,
                "max_rollout_length",
                "at least 1",
            ),
            (self.tool_timeout_s > 0, "tool_timeout_s", "greater than 0"),
            (self.importance_sampling_cap > 0, "importance_sampling_cap", "greater than 0"),
            (self.filter_max_draws >= 1, "filter_max_draws", "at least 1"),
        )


@dataclass
class EntropyMasked(RolloutBatch):
    """A batch with its entropy mask (``entropy_mask``), which its passes and shares carry."""

    keep: np.ndarray | None = None
    """[R, L-1] 1 where a target's entropy reaches the batch's quantile, else 0."""


def with_keep(b: RolloutBatch, keep: np.ndarray, host: dict | None = None) -> EntropyMasked:
    """``b`` carrying the entropy mask ``keep`` (and ``host`` for its host metrics)."""
    kw = {f.name: getattr(b, f.name) for f in fields(RolloutBatch)}
    return EntropyMasked(**{**kw, "host": b.host if host is None else host}, keep=keep)


def carry_keep(batch: RolloutBatch, pieces: list[RolloutBatch]) -> list[RolloutBatch]:
    """``pieces`` (``batch``'s rows, in order), each with its rows of ``batch``'s mask."""
    if not isinstance(batch, EntropyMasked):
        return pieces
    out, at = [], 0
    for p in pieces:
        out.append(with_keep(p, batch.keep[at : at + len(p.tokens)]))
        at += len(p.tokens)
    return out


def high_entropy(entropy: np.ndarray, mask: np.ndarray, top: float) -> np.ndarray:
    """TRL's high-entropy mask: 1 where a target (``mask`` > 0) has an entropy at least the
    (1 - ``top``) quantile of every target's entropy (linear interpolation, as torch.quantile),
    else 0."""
    on = mask > 0
    if not on.any():
        return np.zeros(entropy.shape, np.float32)
    threshold = np.quantile(entropy[on].astype(np.float64), 1.0 - top)
    return (on & (entropy >= threshold)).astype(np.float32)


class GRPO(OnPolicy):
    """GRPO on prompt rows; counts completion tokens (dapo) or completions (grpo, dr_grpo)."""

    name = "grpo"
    Config = GRPOConfig

    def __init__(self, recipe, components):
        super().__init__(recipe, components)
        cfg = self.config
        self.eps_low = cfg.epsilon
        self.eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        top = cfg.entropy_mask
        self.entropy_top = top if top is not None and top < 1 else None  # null: no mask
        self.agent = self._agent(recipe, components) if cfg.tools or cfg.environment else None
        if self.offline and cfg.importance_sampling_correction != "none":
            raise UserInputError(
                "offline groups carry no log-probabilities of the policy that sampled them",
                "objective.importance_sampling_correction",
            )
        if self.offline and cfg.filter_groups:
            raise UserInputError(
                "offline groups are trained as given: drop the groups you do not want from the "
                "file",
                "objective.filter_groups",
            )
        if not self.offline and cfg.scale_rewards == "group" and cfg.num_generations < 2:
            raise UserInputError(
                "a group of one has no spread to compare within: num_generations >= 2, "
                "or scale_rewards: batch / none",
                "objective.num_generations",
            )

    def _agent(self, recipe, components) -> Agent:
        key = "objective.tools" if self.config.tools else "objective.environment"
        if self.offline:
            raise UserInputError(
                "multi-turn rollouts generate their conversations; offline rows give theirs",
                key,
            )
        if isinstance(components.model, VisionLM):
            raise UserInputError("multi-turn rollouts take text models, not vision models", key)
        return Agent(recipe, components)

    def _other_rewards(self) -> bool:
        return bool(self.config.environment)

    def _labels(self) -> list[str]:
        env = ["environment"] if self.config.environment else []
        return super()._labels() + env

    def _positions(self) -> int:
        if self.agent is None:
            return super()._positions()
        longest = max(len(e.prompt_ids) for e in self.components.train_set.examples)
        if self.config.environment:  # its first messages may be longer
            longest = self.recipe.data.max_length
        return read_positions(longest + self.agent.budget(), self._multiple())

    def _held_out(self, prompts, sampling, keys):
        if self.agent is None:
            return super()._held_out(prompts, sampling, keys)
        transcripts, talks, _ = self.agent.run(
            self.components.model, prompts, 1, keys, sampling, self.stop
        )
        total, each = score_talks(self.agent, self.rewards, prompts, transcripts, talks)
        tok = self.components.tokenizer
        texts = [transcript_text(tok, t) for t in transcripts]
        return total, each, [len(t.tokens) for t in transcripts], texts

    def _kl_weight(self) -> float:
        return self.config.beta

    def per_step(self, n: int) -> str:
        if self.offline:
            return f"{n} prompts (given groups)/step"
        return f"{n} prompts x {self.config.num_generations} completions/step"

    def make_batch(self, prompts: list[PromptExample], seed: int) -> RolloutBatch:
        """The completions of ``prompts`` (generated with ``seed``, or the data's), their rewards
        and advantages, as one batch."""
        d = self._draw(prompts, seed)
        if self.config.filter_groups and not self.offline:
            d = filtered(d, self._draw, self._spare, self.config.filter_max_draws, seed)
        adv = advantages(d.rewards, d.groups, self.config.scale_rewards)
        batch = self._rows(d.prompts, d.groups, d.ids, d.ended, adv, d.written, d.read)
        batch.host = d.host
        self._logps(batch, d.drawn)
        return batch

    def _draw(self, prompts: list[PromptExample], seed: int) -> Draw:
        """``prompts``' completions (conversations, with tools), scored."""
        drawn = [] if self.config.importance_sampling_correction != "none" else None
        if self.agent is not None:
            ids, written, ended, groups, rewards, host, read, drawn = rollouts(self, prompts, seed)
            return Draw(prompts, ids, ended, groups, rewards, host, written, read, drawn)
        ids, ended, groups, rewards, host = self.complete(prompts, seed, drawn)
        return Draw(prompts, ids, ended, groups, rewards, host, drawn=drawn)

    def _spare(self, seed: int, draw: int) -> list[PromptExample]:
        """Draw ``draw`` of extra prompts for the batch seeded ``seed`` (group filtering): a
        batch's worth, from the training prompts, by a generator of its own."""
        ds, b = self.components.train_set.examples, self.recipe.train.batch_size
        rng = np.random.default_rng([self.recipe.train.seed, seed, draw])
        return [ds[i] for i in rng.choice(len(ds), size=min(b, len(ds)), replace=False)]

    def _is_weights(self, batch: RolloutBatch, old: np.ndarray, drawn: list) -> None:
        """The truncated importance weights exp(p_old - p_sampled) of the batch's targets, and
        their metrics (the mean weight, and the largest before truncation)."""
        cfg = self.config
        sampled = np.zeros_like(old)
        for i, lps in enumerate(drawn):
            start = int(batch.lengths[i]) - len(lps) - 1  # the completion's first target
            sampled[i, start : start + len(lps)] = lps
        m = batch.mask[:, 1:] > 0
        d = np.where(m, old - sampled, 0.0).astype(np.float64)
        if cfg.importance_sampling_correction == "sequence":
            d = np.broadcast_to(d.sum(axis=-1, keepdims=True), d.shape)
        ratio = np.exp(np.minimum(d, 80.0))
        batch.is_weight = np.where(m, np.minimum(ratio, cfg.importance_sampling_cap), 1.0).astype(
            np.float32
        )
        n = max(int(m.sum()), 1)
        batch.host["is_weight"] = (float(batch.is_weight[m].sum()), n)
        batch.host["is_ratio_max"] = (float(ratio[m].max()) if m.any() else 1.0, 1)

    def _logps(self, batch: RolloutBatch, drawn: list | None = None) -> None:
        """The generating policy's log-probs (``num_iterations`` > 1, or the importance weights
        of ``drawn``, the sampler's) and the reference's (``beta`` > 0) of the batch's targets,
        one forward each, no gradients."""
        want_old = self.config.num_iterations > 1 and self._behaviour is None
        logps = self._target_logps
        with forward_only():
            if want_old or drawn is not None:
                old = self._passes(batch, logps)[0]
                if want_old:
                    batch.old = old
                if drawn is not None:
                    self._is_weights(batch, old, drawn)
            if self._behaviour is not None:
                with self._behaviour.active():
                    batch.old = self._passes(batch, logps)[0]
            if self._reference is not None:
                with self._reference.active():
                    batch.ref = self._passes(batch, logps)[0]

    def prepare(self, run_dir, source, log) -> None:
        super().prepare(run_dir, source, log)
        if self.entropy_top is not None and vocab_split(self.components.lm.head) is not None:
            raise UserInputError(
                "needs each rank's whole head for the entropies: not with a head split by "
                "vocabulary (distributed.strategy: tensor)",
                "objective.entropy_mask",
            )

    # ------------------------------------------------------------------ the entropy mask
    def _hand_out(self, rollout: list[RolloutBatch], j: int) -> RolloutBatch:
        b = super()._hand_out(rollout, j)
        return b if self.entropy_top is None else self._entropy_masked(b)

    def eval_batches(self):
        got = super().eval_batches()
        return got if self.entropy_top is None else [self._entropy_masked(b) for b in got]

    def _entropy_masked(self, b: RolloutBatch) -> EntropyMasked:
        """``b`` with its entropy mask over all its targets, from the policy as it is when the
        batch is handed to its step (one forward over its passes, no gradient), and their mean
        entropy as the ``entropy`` metric."""
        with forward_only():
            ent = self._passes(b, lambda arrays: (self.token_entropies(arrays),))[0]
        on = b.mask[:, 1:] > 0
        host = {**b.host, "entropy": (float(ent[on].sum()), float(on.sum()))}
        return with_keep(b, high_entropy(ent, b.mask[:, 1:], self.entropy_top), host)

    def micro(self, batch: RolloutBatch) -> list[RolloutBatch]:
        return carry_keep(batch, super().micro(batch))

    def split(self, batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
        return carry_keep(batch, super().split(batch, parts))

    def arrays(self, batch: RolloutBatch) -> dict[str, np.ndarray]:
        out = super().arrays(batch)
        out["advantages"] = batch.advantages.astype(np.float32)
        out["valid"] = batch.valid.astype(np.float32)
        if self.entropy_top is not None:  # a batch without one counts nothing (``nothing``)
            keep = getattr(batch, "keep", None)
            out["keep"] = np.zeros(batch.mask[:, 1:].shape, np.float32) if keep is None else keep
        if self.config.importance_sampling_correction != "none":  # ones for a batch that has none
            w = batch.is_weight
            out["is_weight"] = np.ones(batch.mask[:, 1:].shape, np.float32) if w is None else w
        if batch.old is not None:
            out["old"] = batch.old
        if batch.ref is not None:
            out["ref"] = batch.ref
        return out

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        tok, _ = self.token_losses(batch, reduction="none")
        logp = -tok  # [R, L-1], 0 off target
        m = (batch["mask"][:, 1:] > 0).astype(mx.float32)
        valid = batch["valid"]
        old = batch["old"] if "old" in batch else mx.stop_gradient(logp)
        log_ratio = (logp - old) * m
        n = mx.maximum(mx.sum(m, axis=-1), 1.0)
        if cfg.importance_sampling == "sequence":
            log_ratio = (mx.sum(log_ratio, axis=-1) / n)[:, None]
        ratio = mx.exp(log_ratio)
        adv = batch["advantages"][:, None]
        per_token, metrics = self._policy_term(ratio, adv, logp)
        if "keep" in batch:  # entropy_mask: the high-entropy targets' policy term alone
            per_token = per_token * batch["keep"]
        if "is_weight" in batch:  # the sampler's tokens, reweighted towards the trainer's
            per_token = per_token * batch["is_weight"]
        if cfg.beta > 0:
            d = batch["ref"] - logp
            kl = mx.exp(d) - d - 1
            per_token = per_token + cfg.beta * kl
            metrics["kl"] = kl

        def total(x):  # summed as the loss counts: tokens (dapo, cispo) or completions
            x = mx.broadcast_to(x, m.shape) * m
            if cfg.loss in TOKEN_MEAN:
                return mx.sum(x)
            return mx.sum(mx.sum(x, axis=-1) / n * valid)

        if cfg.loss in TOKEN_MEAN:
            loss, count = mx.sum(per_token * m), mx.sum(m)
        elif cfg.loss in ("grpo", "sapo"):
            loss, count = total(per_token), mx.sum(valid)
        else:  # dr_grpo
            loss = mx.sum(per_token * m * valid[:, None]) / cfg.max_completion_length
            count = mx.sum(valid)
        sums = {k: mx.stop_gradient(total(v)) for k, v in metrics.items()}
        return loss, count.astype(mx.int32), sums

    def _policy_term(self, ratio, adv, logp) -> tuple[mx.array, dict]:
        """The policy-gradient part of each token's loss, and the clip metrics of the loss
        type (per token, before they are summed as the loss counts)."""
        cfg = self.config
        if cfg.loss == "cispo":  # the ratio's weight capped and detached: -w A log p
            capped = mx.stop_gradient(mx.minimum(ratio, self.eps_high))
            clipped = ((ratio > self.eps_high) & (adv > 0)).astype(mx.float32)
            return -capped * adv * logp, {"cispo_clip_ratio": clipped}
        if cfg.loss == "sapo":  # a soft clip: sigmoid(tau (r - 1)) x 4 / tau, no hard bound
            tau = mx.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
            return -(mx.sigmoid(tau * (ratio - 1)) * 4 / tau) * adv, {}
        clipped = mx.clip(ratio, 1 - self.eps_low, 1 + self.eps_high)
        low = ((ratio < 1 - self.eps_low) & (adv < 0)).astype(mx.float32)
        high = ((ratio > 1 + self.eps_high) & (adv > 0)).astype(mx.float32)
        metrics = {"clip_ratio/low": low, "clip_ratio/high": high, "clip_ratio": low + high}
        return -mx.minimum(ratio * adv, clipped * adv), metrics

    def count(self, batch: RolloutBatch) -> int:
        if self.config.loss in TOKEN_MEAN:
            return batch.n_targets
        return int(batch.valid.sum())

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict) -> dict:
        n = max(count, 1)
        counted = "eval_tokens" if self.config.loss in TOKEN_MEAN else "eval_completions"
        out = {"eval_loss": loss_sum / n, counted: count}
        out.update({f"eval_{k}": v / n for k, v in metrics.items()})
        return out


__all__ = ["GRPO", "GRPOConfig", "RolloutBatch", "advantages", "high_entropy"]
