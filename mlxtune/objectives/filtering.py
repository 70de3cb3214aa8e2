"""DAPO's dynamic sampling for GRPO: a group whose completions all scored the same has no
advantage to learn from; it is dropped and more prompts are drawn until the batch holds as many
groups as it was drawn with, within a number of draws.

The extra prompts of a batch come from a generator seeded by the batch's own seed and the draw's
number, not from the run's prompt stream: a batch is the same whatever happened before it, so a
resumed run draws what the whole run drew, and epochs count the stream's prompts alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rollout import rollout_seed


@dataclass
class Draw:
    """Completions of some prompts, scored: what a batch is built from."""

    prompts: list
    ids: list[list[int]]
    ended: list[bool]
    groups: list[int]
    rewards: np.ndarray
    host: dict
    written: list[list[int]] | None = None
    read: list[list[int]] | None = None
    drawn: list[list[float]] | None = None

    def spread(self) -> list[bool]:
        """Whether each group's rewards differ."""
        out, at = [], 0
        for g in self.groups:
            r = self.rewards[at : at + g]
            out.append(bool(r.max() - r.min() > 1e-12))
            at += g
        return out

    def take(self, keep: list[int]) -> Draw:
        """The groups ``keep`` (indices), in order."""
        starts = np.cumsum([0, *self.groups])
        rows = [r for i in keep for r in range(starts[i], starts[i + 1])]

        def pick(xs):
            return None if xs is None else [xs[r] for r in rows]

        return Draw(
            [self.prompts[i] for i in keep],
            pick(self.ids),
            pick(self.ended),
            [self.groups[i] for i in keep],
            self.rewards[rows],
            self.host,
            pick(self.written),
            pick(self.read),
            pick(self.drawn),
        )


def _joined(parts: list[Draw], host: dict) -> Draw:
    def cat(name):
        got = [getattr(p, name) for p in parts]
        return None if any(x is None for x in got) else [y for x in got for y in x]

    return Draw(
        cat("prompts"),
        cat("ids"),
        cat("ended"),
        cat("groups"),
        np.concatenate([p.rewards for p in parts]),
        host,
        cat("written"),
        cat("read"),
        cat("drawn"),
    )


def _merged(hosts: list[dict]) -> dict:
    """Host metrics of several draws as one: sums and weights added, maxima the largest."""
    out: dict = {}
    for h in hosts:
        for k, (v, w) in h.items():
            if k not in out:
                out[k] = (v, w)
            elif k.endswith("_max"):
                out[k] = (max(out[k][0], v), 1)
            else:
                out[k] = (out[k][0] + v, out[k][1] + w)
    return out


def filtered(first: Draw, draw, spare, max_draws: int, seed: int) -> Draw:
    """``first`` without its groups of equal rewards, topped up from further draws
    (``draw(spare(seed, n), seed_n)``) to its number of groups, ``max_draws`` draws at most.
    When no group of any draw has a spread, the first draw is kept as it is (its advantages are
    0: its step trains the KL term alone). Host metrics cover every completion drawn, with
    ``filtered_groups`` (the share of drawn groups dropped) and ``filter_draws``."""
    want = len(first.groups)
    parts, hosts, dropped, drawn, d, n = [], [first.host], 0, 0, first, 0
    have = 0
    while True:
        spread = d.spread()
        keep = [i for i, s in enumerate(spread) if s][: want - have]
        dropped += sum(not s for s in spread)
        drawn += len(spread)
        if keep:
            parts.append(d.take(keep))
            have += len(keep)
        n += 1
        if have >= want or n >= max_draws:
            break
        d = draw(spare(seed, n), rollout_seed(seed, n))
        hosts.append(d.host)
    host = _merged(hosts)
    host["filtered_groups"] = (float(dropped), drawn)
    host["filter_draws"] = (float(n), 1)
    if not parts:
        first.host = host
        return first
    return _joined(parts, host)


__all__ = ["Draw", "filtered"]
