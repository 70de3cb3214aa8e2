"""The runtime memory policy of the step: recognising an out-of-memory failure (and Metal's
limit on live buffers) mid-run, the wired limit a run sets on Apple silicon, when MLX's buffer
cache is freed, and a warning when active memory creeps up from step to step. The plan made
before a run starts is ``mlxtune.memory``."""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager

import mlx.core as mx

GB = 1e9
_OOM_MARKS = (
    "unable to allocate",  # MLX's Metal and CUDA allocators
    "attempting to allocate",  # Metal: larger than the biggest buffer
    "resource limit",  # Metal: too many buffers
    "insufficient memory",  # Metal command buffer
    "outofmemory",
    "out of memory",  # CUDA
    "cudaerrormemoryallocation",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception is MLX (or the system) running out of memory."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower().replace("_", "")
    return isinstance(exc, RuntimeError) and any(m.replace("_", "") in text for m in _OOM_MARKS)


RESOURCE_LIMIT = "resource limit"


def resource_limit_note(exc: BaseException) -> str | None:
    """What Metal's resource limit means, when ``exc`` is it (too many live buffers, not too
    many bytes): None otherwise."""
    if RESOURCE_LIMIT not in str(exc).lower():
        return None
    return (
        "Metal's limit on the number of live buffers was reached (a count, not bytes; a long "
        "run's cache of freed buffers counts too): memory.clear_cache_every (say 50) or "
        "memory.clear_cache_gb frees the cache as the run goes"
    )


def wired_limit(info: dict, metal: bool) -> int | None:
    """The wired memory limit a run sets on Apple silicon: Metal's recommended working set,
    as mlx-lm's trainer does (the model's weights and the step's buffers are kept resident
    instead of paged); None off Metal or where the device does not say."""
    if not metal:
        return None
    size = info.get("max_recommended_working_set_size")
    return int(size) if size else None


def keep_resident(log) -> None:
    """On Apple silicon, set ``wired_limit``'s limit for this process and say so."""
    wired = wired_limit(mx.device_info(), mx.metal.is_available())
    if wired is not None:
        mx.set_wired_limit(wired)
        log(
            f"memory: wired limit {wired / GB:.1f} GB (Metal's recommended working "
            "set: the weights and the step's buffers stay resident)"
        )


def should_clear_cache(step: int, cache_bytes: float, every: int | None, gb: float | None) -> bool:
    """Whether MLX's buffer cache is freed after ``step``: every ``every`` steps
    (memory.clear_cache_every), or when it holds more than ``gb`` GB (memory.clear_cache_gb)."""
    if every and step % every == 0:
        return True
    return gb is not None and cache_bytes > gb * GB


def creeping(
    samples: list[tuple[int, float]], at_least: int = 4, share: float = 0.05
) -> str | None:
    """A warning when active memory, sampled (step, bytes) at each checkpoint, has grown at
    every one of the last ``at_least`` samples and by more than ``share`` over them: memory
    that creeps up while the step's peak stays flat (a leak a long run meets); None
    otherwise."""
    if len(samples) < at_least:
        return None
    last = samples[-at_least:]
    values = [b for _, b in last]
    rising = all(b2 > b1 for b1, b2 in zip(values, values[1:], strict=False))
    if not rising or values[-1] <= values[0] * (1 + share):
        return None
    return (
        f"active memory grew at each of the last {at_least} checkpoints, "
        f"{values[0] / GB:.2f} -> {values[-1] / GB:.2f} GB from step {last[0][0]} to "
        f"{last[-1][0]} (+{values[-1] / values[0] - 1:.0%}): something holds arrays from step "
        "to step (a callback keeping results?). The metrics rows' active_memory_gb and "
        "cache_memory_gb show it"
    )


def resident_peak() -> float:
    """The process's peak resident memory so far, in bytes (VmHWM on Linux, ru_maxrss
    elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    r = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return r if sys.platform == "darwin" else r * 1024  # bytes on macOS, KiB on Linux


@contextmanager
def stage(name: str, stages: dict):
    """Time a stage of a run (loading, a checkpoint, an export) and see whether it set the
    process's peak memory: ``stages[name]`` gets its seconds, the peak resident memory and
    MLX's peak after it, and whether this stage raised either (so a stage's own peak is the one
    recorded when it did, and below the earlier one when it did not). Peaks are read, never
    reset, so a tool measuring the whole process sees what it would without this."""
    rss0, mlx0, t0 = resident_peak(), mx.get_peak_memory(), time.perf_counter()
    yield
    seconds, rss, peak = time.perf_counter() - t0, resident_peak(), mx.get_peak_memory()
    stages[name] = {
        "seconds": round(seconds, 2),
        "peak_resident_gb": round(rss / GB, 3),
        "peak_mlx_gb": round(peak / GB, 3),
        "raised_peak": rss > rss0 * 1.01 or peak > mlx0 * 1.01,
    }


def described(record: dict) -> str:
    """A ``stage`` record as the log says it."""
    if record["raised_peak"]:
        where = (
            f"peak memory now {record['peak_resident_gb']:.2f} GB resident, "
            f"{record['peak_mlx_gb']:.2f} GB in MLX"
        )
    else:
        where = f"within the earlier peak of {record['peak_resident_gb']:.2f} GB resident"
    return f"{record['seconds']:.1f} s, {where}"
