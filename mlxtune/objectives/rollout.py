"""A rollout as a training batch: completions of prompts as rows, grouped by prompt, with what
the reinforcement-learning losses read besides (advantages, old and reference log-probs, PPO's
values and returns), and the ways a rollout is cut into passes, shares and minibatches."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..data import Batch
from ..distributed import collectives
from ..errors import UserInputError

ROLLOUT_ARRAYS = (
    "advantages",
    "valid",
    "old",
    "ref",
    "is_weight",
    "values",
    "returns",
    "token_advantages",
    "side",
)
"""The per-row arrays a RolloutBatch carries beside tokens and mask (what a checkpoint inside a
rollout keeps)."""
ADV_EPS = 1e-4  # added to the standard deviation the advantages are divided by


@dataclass
class RolloutBatch(Batch):
    """Completions of some prompts as rows (prompt, then completion, right-padded; the mask marks
    completion tokens), grouped by prompt, with what the loss reads besides."""

    advantages: np.ndarray | None = None
    """[R] each completion's advantage."""
    valid: np.ndarray | None = None
    """[R] 1 for a completion, 0 for a row that counts nothing."""
    groups: tuple[int, ...] = ()
    """Rows of each prompt's group, in order."""
    old: np.ndarray | None = None
    """[R, L-1] the generating policy's log-probs of the targets (num_iterations > 1)."""
    ref: np.ndarray | None = None
    """[R, L-1] the reference policy's (beta > 0)."""
    is_weight: np.ndarray | None = None
    """[R, L-1] the truncated importance weights of the sampler's log-probs (GRPO's
    importance_sampling_correction)."""
    values: np.ndarray | None = None
    """[R, L-1] PPO: the value head's estimates at generation."""
    returns: np.ndarray | None = None
    """[R, L-1] PPO: the returns the values are trained towards."""
    token_advantages: np.ndarray | None = None
    """[R, L-1] PPO: each target token's (whitened) advantage."""
    side: np.ndarray | None = None
    """[R] online DPO: 1 for its pair's chosen completion, -1 for the rejected one."""
    prompts: int = 0
    """Prompts counted as seen: the rollout's first iteration counts them, the others 0."""
    host: dict = field(default_factory=dict)
    """Metrics made on the host (rewards, lengths, generation time): name -> (sum, weight);
    names ending in _max carry (max, 1)."""


def advantages(rewards: np.ndarray, groups: list[int], scale: str) -> np.ndarray:
    """Each reward minus its group's mean, divided by the group's (``group``) or the whole
    batch's (``batch``) sample standard deviation + 1e-4, or not (``none``)."""
    out = np.zeros_like(rewards, dtype=np.float64)
    at = 0
    whole = rewards.std(ddof=1) if scale == "batch" and len(rewards) > 1 else 0.0
    for g in groups:
        r = rewards[at : at + g].astype(np.float64)
        a = r - r.mean()
        if scale == "group":
            a = a / ((r.std(ddof=1) if g > 1 else 0.0) + ADV_EPS)
        elif scale == "batch":
            a = a / (whole + ADV_EPS)
        out[at : at + g] = a
        at += g
    return out.astype(np.float32)


def gather_completions(
    world, mine: list[list[int]], rows: int, where, width: int
) -> list[list[int]]:
    """Every rank's completions, all of them in row order: rank r's ``mine`` are rows ``where``;
    each rank fills its rows of a [rows, width] table (token + 1, 0 past the end) and the
    tables are summed over the ranks."""
    table = np.zeros((rows, width), np.int32)
    for r, ids in zip(where, mine, strict=True):
        table[r, : len(ids)] = np.asarray(ids, np.int32) + 1
    got = world.all_sum(mx.array(table))
    with collectives(world):
        mx.eval(got)
    return [[int(t) - 1 for t in row if t > 0] for row in np.array(got)]


def gather_floats(
    world, mine: list[list[float]], rows: int, where, width: int
) -> list[list[float]]:
    """``gather_completions`` for per-token numbers: every rank's rows, in row order (a row's
    list as long as its rank gave it)."""
    table = np.zeros((rows, width), np.float32)
    sizes = np.zeros((rows,), np.float32)
    for r, xs in zip(where, mine, strict=True):
        table[r, : len(xs)], sizes[r] = xs, len(xs)
    got, n = world.all_sum(mx.array(table)), world.all_sum(mx.array(sizes))
    with collectives(world):
        mx.eval(got, n)
    return [row[: int(k)].tolist() for row, k in zip(np.array(got), np.array(n), strict=True)]


def reward_means(host: dict, each: dict) -> None:
    for label, vals in each.items():
        got = [v for v in vals if v is not None]
        host[f"rewards/{label}"] = (float(sum(got)), len(got))


def handed_again(b: RolloutBatch) -> RolloutBatch:
    """``b`` handed out once more: nothing in it counts as seen again."""
    out = rows_of(b, slice(0, len(b.tokens)), b.groups, 0, False)
    return out


def rollout_seed(seed: int, k: int) -> int:
    """A sampling seed for rollout ``k`` of a run seeded ``seed``."""
    return int(np.random.SeedSequence([seed, k]).generate_state(1, np.uint64)[0] >> 1)


def even_sizes(n: int, parts: int) -> list[int]:
    """``n`` as ``parts`` sizes that differ by at most one, the larger first."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def cut_rows(b: RolloutBatch, sizes: list[int]) -> list[RolloutBatch]:
    """``b``'s rows in consecutive parts of ``sizes``, each with the pieces of the groups it
    holds; the first part carries the batch's prompt count and host metrics."""
    starts = np.cumsum((0, *b.groups))
    out, lo = [], 0
    for i, n in enumerate(sizes):
        hi = lo + n
        gs = [
            int(min(e, hi) - max(s, lo))
            for s, e in zip(starts[:-1], starts[1:], strict=True)
            if s < hi and e > lo
        ]
        out.append(rows_of(b, slice(lo, hi), gs, b.prompts if i == 0 else 0, i == 0))
        lo = hi
    return out


def rows_of(b: RolloutBatch, rows, groups, prompts: int, host: bool) -> RolloutBatch:
    """Rows ``rows`` (a slice or indices) of ``b`` as a batch of ``groups``."""
    rows = np.arange(len(b.tokens))[rows]
    mask = b.mask[rows]
    return RolloutBatch(
        b.tokens[rows],
        mask,
        int(mask[:, 1:].sum()),
        tuple(b.lengths[i] for i in rows),
        groups=tuple(groups),
        **{k: None if getattr(b, k) is None else getattr(b, k)[rows] for k in ROLLOUT_ARRAYS},
        prompts=prompts,
        host=b.host if host else {},
    )


def save_rollout(path, batches: list[RolloutBatch], meta: dict[str, str]) -> None:
    """A rollout's batches (every array they carry) in one safetensors file, with ``meta``."""
    arrays = {}
    for j, b in enumerate(batches):
        arrays[f"{j}.tokens"] = mx.array(b.tokens)
        arrays[f"{j}.mask"] = mx.array(b.mask)
        arrays[f"{j}.lengths"] = mx.array(np.array(b.lengths, np.int32))
        arrays[f"{j}.groups"] = mx.array(np.array(b.groups, np.int32))
        for name in ROLLOUT_ARRAYS:
            if getattr(b, name) is not None:
                arrays[f"{j}.{name}"] = mx.array(getattr(b, name))
    mx.save_safetensors(str(path), arrays, metadata=meta)


def load_rollout(path, count: int) -> tuple[list[RolloutBatch], dict[str, str]]:
    """The ``count`` batches ``save_rollout`` wrote to ``path``, and its meta; a file of another
    size is a UserInputError."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    batches = []
    for j in range(count):
        a = {k.split(".", 1)[1]: np.array(v) for k, v in arrays.items() if k.startswith(f"{j}.")}
        if not a:
            raise UserInputError("holds a rollout of other sizes than this recipe's", str(path))
        mask = a["mask"].astype(np.int32)
        batches.append(
            RolloutBatch(
                a["tokens"].astype(np.int32),
                mask,
                int(mask[:, 1:].sum()),
                tuple(int(x) for x in a["lengths"]),
                groups=tuple(int(x) for x in a["groups"]),
                **{name: a.get(name) for name in ROLLOUT_ARRAYS},
            )
        )
    return batches, meta


__all__ = [
    "rollout_seed",
    "ADV_EPS",
    "ROLLOUT_ARRAYS",
    "RolloutBatch",
    "advantages",
    "cut_rows",
    "even_sizes",
    "gather_completions",
    "handed_again",
    "load_rollout",
    "reward_means",
    "rows_of",
    "save_rollout",
]
