"""The held-out reward of the on-policy objectives: one completion of each validation prompt,
scored by the reward functions, measured before the first step and at every evaluation."""

from __future__ import annotations

import mlx.core as mx

from ..generate import Sampling, decode_answer, generate_ids
from .rollout import rollout_seed


class HeldOutReward:
    """``evaluate`` for objectives whose completions the reward functions score (a mixin of
    ``OnPolicy``: it reads the objective's config, components, rewards and stop strings)."""

    def evaluate(self, engine, world) -> dict:
        """Held-out reward: one completion of each validation prompt (at ``eval_temperature``),
        scored by the reward functions; ``eval_loss`` is its negative (lower is better, as for
        every objective). Offline without reward functions: the loss on the validation groups."""
        if not self.rewards and not self._other_rewards():
            return super().evaluate(engine, world)
        cfg, c, r = self.config, self.components, self.recipe
        examples = c.valid_set.examples
        if r.eval.max_batches:
            examples = examples[: r.eval.max_batches * self.eval_batch_size]
        mine = examples[world.rank :: world.size]
        sums = {"reward": 0.0, "n": 0.0, "completion_length": 0.0}
        labels = self._labels()
        for lb in labels:
            sums[f"rewards/{lb}"] = sums[f"rewards/{lb}#"] = 0.0
        shown = []
        if mine:
            sampling = Sampling(cfg.eval_temperature, cfg.top_k, cfg.top_p, cfg.min_p)
            keys = mx.random.split(mx.random.key(rollout_seed(r.train.seed, 1 << 40)), len(mine))
            total, each, lengths, texts = self._held_out(mine, sampling, keys)
            sums["reward"], sums["n"] = float(total.sum()), float(len(mine))
            sums["completion_length"] = float(sum(lengths))
            for lb in labels:
                vals = [v for v in each[lb] if v is not None]
                sums[f"rewards/{lb}"], sums[f"rewards/{lb}#"] = float(sum(vals)), float(len(vals))
            shown = [
                {"prompt": p.shown_prompt, "prompt_text": p.prompt, "reward": float(t),
                 "completion": x}
                for p, x, t in list(zip(mine, texts, total, strict=True))[:2]
            ]  # fmt: skip
        names = sorted(sums)
        if world.size > 1:
            got = world.agree([sums[k] for k in names])
            sums = dict(zip(names, got, strict=True))
        self.eval_samples = shown if world.main else []
        n = max(sums["n"], 1.0)
        out = {
            "eval_loss": -sums["reward"] / n,
            "eval_reward": sums["reward"] / n,
            "eval_prompts": int(sums["n"]),
            "eval_completion_length": sums["completion_length"] / n,
        }
        for lb in labels:
            k = sums[f"rewards/{lb}#"]
            out[f"eval_rewards/{lb}"] = sums[f"rewards/{lb}"] / k if k else None
        return out

    def _held_out(self, prompts, sampling, keys):
        """One completion of each held-out prompt: (rewards, each function's values, lengths,
        texts shown in samples)."""
        c = self.components
        new = generate_ids(
            c.model,
            [p.prompt_ids for p in prompts],
            self.config.max_completion_length,
            self.eos,
            sampling=sampling,
            keys=keys,
            stop=self.stop,
        )
        total, each = self._score(prompts, [1] * len(prompts), new)
        return total, each, [len(x) for x in new], [decode_answer(c.tokenizer, x) for x in new]


__all__ = ["HeldOutReward"]
