"""The recipe's memory and distributed sections (part of the schema; see ``schema``): what a
run may use of its machine, and how several processes share the work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class MemoryConfig:
    """Memory planning before the run, and what running out of memory mid-run does."""

    limit_gb: float | None = None
    """The memory the run may use, in GB; null: the device's (the GPU's recommended working set,
    or this machine's RAM on the CPU)."""
    check: Literal["refuse", "warn", "off"] = "refuse"
    """When the estimated peak is over the limit: "refuse" to start (exit 2, listing changes that
    would fit), "warn" and go on, or "off"."""
    oom_fallback: bool = True
    """On an out-of-memory failure mid-run: halve the micro-batch and double grad_accumulation
    (the same examples per step), say so, and retry the step."""
    clear_cache_every: int | None = None
    """Free MLX's cache of released buffers every N steps (mx.clear_cache); null: never on a
    schedule. On a long Metal run the cache counts towards the limit on live buffers."""
    clear_cache_gb: float | None = None
    """Free MLX's buffer cache after a step where it holds more than this many GB; null: no
    threshold."""


@dataclass
class DistributedConfig:
    """Runs of several processes (``mlxtune run --nproc N``, ``mlx.launch``)."""

    strategy: Literal["data", "fsdp", "tensor"] = "data"
    """How the ranks share the work (docs/distributed.md). data: each holds the whole model and
    trains on its share of a batch's rows. fsdp: the same rows, each holding 1/N of every
    block's weights, gradients and optimizer state, gathered a block at a time. tensor: each
    computes on the whole batch with 1/N of every block's heads and MLP columns and of the
    head's vocabulary. fsdp and tensor fit models one machine cannot train; their checkpoints
    are whole (any world size or strategy resumes them); both need adamw, adam, lion or sgd.
    One process: no effect."""

    timeout_s: float | Literal["auto"] | None = "auto"
    """How long a rank waits on the others before it gives up on them: a rank that froze, slept
    or dropped off the network without closing its link never fails a collective. Every live
    rank then exits (code 1) naming the silent rank, the step and the resume command; the last
    checkpoint is intact. auto: 20 x the longest wait so far, at least 300 s (ranks on one
    machine also see one another alive, and give up on a frozen one after 15 s); null: wait
    forever."""
