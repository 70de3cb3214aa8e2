"""PPO for language models (the RLHF recipe): the policy with a value head on its hidden states,
trained together; per-token rewards made of a KL penalty to the reference and the completion's
score at its last token; GAE advantages; the clipped policy loss, the clipped value loss and an
entropy bonus; several epochs of minibatches over each rollout.

A rollout is ``train.batch_size`` prompts completed ``num_generations`` times each by the policy as
it is. Each completion is scored by the recipe's reward functions and/or a reward model
(``reward_model``: a run of ``objective.type: reward``, or one of its checkpoints); one forward of
the policy gives the generating log-probs ``p_old`` and the values ``V``, and the reference's
forward ``q``. Per target token t of a completion::

    r_t = -kl_coef (p_old_t - q_t)  (+ the score at the completion's last token)
    delta_t = r_t + gamma V_{t+1} - V_t          (V after the last token: 0)
    A_t = delta_t + gamma lam A_{t+1},  R_t = A_t + V_t

and the advantages are whitened over the rollout's tokens. The rollout then hands out
``ppo_epochs`` x ``num_mini_batches`` minibatches (a seeded shuffle of its completions each
epoch); each optimizer step takes ``grad_accumulation`` of them, with the loss per token

    max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange))
      + vf_coef 0.5 max((v - R)^2, (clip(v, V - cliprange_value, V + cliprange_value) - R)^2)
      - entropy_coef H

(``r = exp(p - p_old)``, ``v`` the value head now), averaged over the minibatch's tokens. With
``kl_target`` the KL coefficient adapts after each rollout (Ziegler et al.): multiplied by
``1 + clip(kl / kl_target - 1, -0.2, 0.2) x completions / kl_horizon``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserInputError
from ..kernels import forward_only
from ..models import add_value_head, reward_head, value_head
from ..runs.checkpoint import load_trained
from .base import Objective
from .online import OnPolicy, RLConfig
from .rollout import RolloutBatch, rows_of

STATE_FILE = "ppo_state.json"


@dataclass
class PPOConfig(RLConfig):
    """Proximal policy optimisation with a value head, GAE and a KL penalty to the reference."""

    type: str = "ppo"
    """This objective."""
    num_generations: int = 1
    """Completions drawn for each prompt."""
    kl_coef: float = 0.05
    """Weight of the per-token KL penalty (policy log-prob minus the reference's) in the
    rewards; 0: no reference pass."""
    kl_target: float | None = None
    """Adapt kl_coef after each rollout towards this KL per completion (null: fixed)."""
    kl_horizon: int = 10000
    """How fast the adaptive coefficient moves: completions over which it may change by 20%."""
    gamma: float = 1.0
    """Discount of later rewards."""
    lam: float = 0.95
    """GAE's lambda: 0 trusts the values, 1 the rewards."""
    cliprange: float = 0.2
    """Clip range of the policy's probability ratio."""
    cliprange_value: float = 0.2
    """How far a value may move from its estimate at generation before its loss is clipped."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (> 0 computes each target position's full distribution)."""
    ppo_epochs: int = 4
    """Passes over each rollout."""
    num_mini_batches: int = 1
    """Minibatches each pass splits the rollout into (each one a micro-batch of a step)."""
    whiten_advantages: bool = True
    """Shift and scale the rollout's advantages to mean 0, standard deviation 1."""
    reward_model: str | None = None
    """A reward model (a run of objective.type: reward, or a checkpoint of one) scoring each
    completion, added to the reward functions' sum."""

    def checks(self) -> tuple:
        adapts = self.kl_target is not None
        return super().checks() + (
            (self.kl_coef >= 0, "kl_coef", "at least 0"),
            (not adapts or self.kl_target > 0, "kl_target", "greater than 0"),
            (not adapts or self.kl_coef > 0, "kl_coef", "above 0 to adapt"),
            (self.kl_horizon >= 1, "kl_horizon", "at least 1"),
            (0 < self.gamma <= 1, "gamma", "in (0, 1]"),
            (0 <= self.lam <= 1, "lam", "in [0, 1]"),
            (0 < self.cliprange < 1, "cliprange", "in (0, 1)"),
            (self.cliprange_value > 0, "cliprange_value", "greater than 0"),
            (self.vf_coef >= 0, "vf_coef", "at least 0"),
            (self.entropy_coef >= 0, "entropy_coef", "at least 0"),
            (self.ppo_epochs >= 1, "ppo_epochs", "at least 1"),
            (self.num_mini_batches >= 1, "num_mini_batches", "at least 1"),
        )


def gae(rewards: np.ndarray, values: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """Generalised advantage estimates of one completion's tokens (float64), the value after the
    last token 0."""
    out = np.zeros(len(rewards), np.float64)
    last = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        nxt = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * nxt - values[t]
        last = delta + gamma * lam * last
        out[t] = last
    return out


class PPO(OnPolicy):
    """PPO on prompt rows; counts completion tokens."""

    name = "ppo"
    Config = PPOConfig
    offline_refusal = (
        "PPO learns from its own completions: offline rows (responses and rewards) train with "
        "objective.type grpo"
    )

    def __init__(self, recipe, components):
        self._rm = None
        super().__init__(recipe, components)
        if value_head(components.model) is None:
            raise RuntimeError("PPO.extend() was not called: the model has no value head")
        self.kl_coef = float(self.config.kl_coef)

    def _kl_weight(self) -> float:
        return self.config.kl_coef

    def _other_rewards(self) -> bool:
        return self.config.reward_model is not None

    def _labels(self) -> list[str]:
        return super()._labels() + (["reward_model"] if self.config.reward_model else [])

    def per_step(self, n: int) -> str:
        cfg, t = self.config, self.recipe.train
        return (
            f"rollouts of {t.batch_size} prompts x {cfg.num_generations} completions, each "
            f"trained {cfg.ppo_epochs} epochs x {cfg.num_mini_batches} minibatches, "
            f"{t.grad_accumulation} minibatch(es)/step"
        )

    # ------------------------------------------------------------------ set-up
    @classmethod
    def extend(cls, recipe, model, log) -> None:
        hidden = int(model.args.hidden_size)
        add_value_head(model, hidden)
        log(
            f"value head: a trainable {hidden} -> 1 value at each position (checkpointed, not exported)"
        )

    def prepare(self, run_dir, source, log) -> None:
        super().prepare(run_dir, source, log)
        ref = self.config.reward_model
        if ref is not None:
            self._rm = self._load_reward_model(ref, log)

    def _load_reward_model(self, ref: str, log):
        path = self.recipe.resolve_path(ref)
        if path is None or not path.exists():
            raise UserInputError(f"no such run or checkpoint: {path}", "objective.reward_model")
        t = load_trained(path, lambda m: log(f"WARNING: {m}"))
        if reward_head(t.model) is None:
            raise UserInputError(
                "this is no reward model (train one with objective.type: reward)",
                "objective.reward_model",
            )
        mine, theirs = self.components.tokenizer, t.tokenizer
        if theirs is None or len(theirs.get_vocab()) != len(mine.get_vocab()):
            raise UserInputError(
                "the reward model reads another vocabulary than the policy's tokenizer",
                "objective.reward_model",
            )
        t.model.eval()
        log(f"reward model: {path}")
        return t.model

    # ------------------------------------------------------------------ rollouts
    def _batches_per_rollout(self) -> int:
        return 1

    def _yields(self) -> int:
        return self.config.ppo_epochs * self.config.num_mini_batches

    def _steps_per_rollout(self) -> float:
        return self._yields() / self.recipe.train.grad_accumulation

    def _hand_out(self, rollout: list[RolloutBatch], j: int) -> RolloutBatch:
        """Minibatch ``j % M`` of epoch ``j // M``: a seeded shuffle of the rollout's rows."""
        b = rollout[0]
        m = self.config.num_mini_batches
        epoch, i = divmod(j, m)
        k = self._rollout[0] if self._rollout is not None else 0
        order = np.random.default_rng([self.recipe.train.seed, k, epoch]).permutation(len(b.tokens))
        size = -(-len(order) // m)
        rows = np.sort(order[i * size : (i + 1) * size])
        out = rows_of(b, rows, (1,) * len(rows), b.prompts if j == 0 else 0, j == 0)
        return out

    def _score(self, prompts, groups, new) -> tuple[np.ndarray, dict]:
        if not self.rewards:
            total, each = np.zeros(len(new), np.float64), {}
        else:
            total, each = super()._score(prompts, groups, new)
        if self._rm is not None:
            scores = self._rm_scores(prompts, groups, new)
            each["reward_model"] = [float(x) for x in scores]
            total = total + scores
        return total, each

    def _rm_scores(self, prompts, groups, new) -> np.ndarray:
        """The reward model's score of each prompt + completion (EOS appended, as it was
        trained), at its last token."""
        eos = self._eos_id
        ids = [list(n) + ([eos] if eos is not None else []) for n in new]
        b = self._rows(prompts, groups, ids, [True] * len(ids), np.zeros(len(ids), np.float32))
        rm = self._rm
        with forward_only():
            h = rm.model(mx.array(b.tokens))
            last = mx.array(np.array(b.lengths) - 1)
            picked = h[mx.arange(len(b.tokens)), last]
            out = rm.score(picked.astype(mx.float32))[:, 0]
        return np.array(out, np.float64)

    def make_batch(self, prompts, seed: int) -> RolloutBatch:
        """Completions, their scores, the generating policy's log-probs and values, the
        reference's log-probs, and per-token advantages and returns (GAE)."""
        cfg = self.config
        ids, ended, groups, scores, host = self.complete(prompts, seed)
        n = len(ids)
        batch = self._rows(prompts, groups, ids, ended, np.zeros(n, np.float32))
        batch.groups = (1,) * n  # completions train apart: minibatches shuffle them
        if cfg.num_generations == 1:  # no groups to compare within
            host.pop("reward_std", None)
            host.pop("frac_reward_zero_std", None)
        logp, values = self._policy_pass(batch)
        m = batch.mask[:, 1:] > 0
        ref = self._reference_logps(batch) if self._reference is not None else logp
        kl = np.where(m, logp - ref, 0.0)
        adv = np.zeros(m.shape, np.float64)
        ret = np.zeros(m.shape, np.float64)
        for i in range(n):
            where = np.flatnonzero(m[i])
            if not len(where):
                continue
            r = -self.kl_coef * kl[i, where]
            r[-1] += scores[i]
            a = gae(r, values[i, where].astype(np.float64), cfg.gamma, cfg.lam)
            adv[i, where] = a
            ret[i, where] = a + values[i, where]
        count = max(int(m.sum()), 1)
        if cfg.whiten_advantages and m.sum() > 1:
            mean = adv[m].mean()
            std = adv[m].std(ddof=1)
            adv = np.where(m, (adv - mean) / (std + 1e-8), 0.0)
        batch.old = logp.astype(np.float32)
        batch.values = values.astype(np.float32)
        batch.returns = ret.astype(np.float32)
        batch.token_advantages = adv.astype(np.float32)
        per_seq = kl.sum(axis=1)
        host["kl"] = (float(per_seq.sum()), n)
        host["non_score_reward"] = (float(-self.kl_coef * per_seq.sum()), n)
        host["kl_coef"] = (self.kl_coef, 1)
        resid = (ret - values)[m]
        var = ret[m].var()
        host["explained_variance"] = (float(1 - resid.var() / var) if var > 0 else 0.0, 1)
        host["value_mean"] = (float(values[m].sum()), count)
        batch.host = host
        if cfg.kl_target is not None:  # Ziegler et al.'s adaptive controller, for the next one
            err = float(np.clip(per_seq.mean() / cfg.kl_target - 1, -0.2, 0.2))
            self.kl_coef *= 1 + err * n / cfg.kl_horizon
        return batch

    def _policy_pass(self, batch: RolloutBatch) -> tuple[np.ndarray, np.ndarray]:
        """The policy's per-token log-probs and values [R, L-1] (no gradients, eval mode)."""
        model = self.components.model

        def both(arrays):
            h = self.hidden(arrays)
            tok, _ = self.token_losses(arrays, reduction="none", hidden=h)
            return -tok, model.value_head(h.astype(mx.float32))[..., 0]

        with forward_only():
            logp, values = self._passes(batch, both)
        return logp, values

    def _reference_logps(self, batch: RolloutBatch) -> np.ndarray:
        with forward_only(), self._reference.active():
            return self._passes(batch, self._target_logps)[0]

    # ------------------------------------------------------------------ the loss
    def arrays(self, batch: RolloutBatch) -> dict[str, np.ndarray]:
        out = Objective.arrays(self, batch)
        out["old"] = batch.old
        out["values"] = batch.values
        out["returns"] = batch.returns
        out["advantages"] = batch.token_advantages
        return out

    def loss(self, model: nn.Module, batch: dict[str, mx.array]):
        cfg = self.config
        h = self.hidden(batch)
        tok, _ = self.token_losses(batch, reduction="none", hidden=h)
        logp = -tok
        m = (batch["mask"][:, 1:] > 0).astype(mx.float32)
        adv, old = batch["advantages"], batch["old"]
        ratio = mx.exp((logp - old) * m)
        c = cfg.cliprange
        pg1, pg2 = -adv * ratio, -adv * mx.clip(ratio, 1 - c, 1 + c)
        pg = mx.maximum(pg1, pg2)
        v = model.value_head(h.astype(mx.float32))[..., 0]
        v_old, ret = batch["values"], batch["returns"]
        cv = cfg.cliprange_value
        v_clip = v_old + mx.clip(v - v_old, -cv, cv)
        vf1, vf2 = mx.square(v - ret), mx.square(v_clip - ret)
        vf = 0.5 * mx.maximum(vf1, vf2)
        per = pg + cfg.vf_coef * vf
        metrics = {
            "policy_loss": mx.sum(mx.stop_gradient(pg) * m),
            "value_loss": mx.sum(mx.stop_gradient(vf) * m),
            "clip_ratio": mx.sum((pg2 > pg1).astype(mx.float32) * m),
            "value_clip_ratio": mx.sum((vf2 > vf1).astype(mx.float32) * m),
            "approx_kl": mx.sum(0.5 * mx.square(mx.stop_gradient(logp - old)) * m),
        }
        if cfg.entropy_coef > 0:
            ent = self._entropy(h)
            per = per - cfg.entropy_coef * ent
            metrics["entropy"] = mx.sum(mx.stop_gradient(ent) * m)
        return mx.sum(per * m), mx.sum(m).astype(mx.int32), metrics

    def _entropy(self, h: mx.array) -> mx.array:
        """[R, L-1] the entropy of each position's next-token distribution (fp32 logits)."""
        lm = self.components.lm
        z = lm.logits(h)
        lse = mx.logsumexp(z, axis=-1, keepdims=True)
        p = mx.exp(z - lse)
        return lse[..., 0] - mx.sum(p * z, axis=-1)

    def count(self, batch: RolloutBatch) -> int:
        return batch.n_targets

    def _batch_rows(self) -> int:
        """A minibatch: the rollout's completions over num_mini_batches."""
        return -(-super()._batch_rows() // self.config.num_mini_batches)

    def generation_layout(self) -> tuple[int, int] | None:
        _, capacity = super().generation_layout()
        return OnPolicy._batch_rows(self), capacity  # the whole rollout, not a minibatch

    def eval_metrics(self, loss_sum: float, count: int, metrics: dict) -> dict:
        n = max(count, 1)
        out = {"eval_loss": loss_sum / n, "eval_tokens": count}
        out.update({f"eval_{k}": v / n for k, v in metrics.items()})
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, folder) -> None:
        super().save(folder)
        (folder / STATE_FILE).write_text(json.dumps({"kl_coef": self.kl_coef}))

    def restore(self, folder) -> None:
        super().restore(folder)
        path = folder / STATE_FILE
        if path.exists():
            self.kl_coef = float(json.loads(path.read_text())["kl_coef"])


__all__ = ["PPO", "PPOConfig", "gae"]
