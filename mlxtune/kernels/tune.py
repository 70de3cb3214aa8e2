"""Kernel tiers chosen by measurement: each op a run calls (attention, the loss) at each shape its
batches take is timed in every tier that passed its check here, forward and backward, compiled
as the step compiles it; among the tiers whose step fits the memory budget the fastest is taken.
Times are cached per device, MLX version, kernel sources, dtype and shape.

The policy (``decide``) takes its clock and its memory probe as arguments, so that it can be
held against made-up times; ``time_case`` is the clock a run uses, ``TimeCache`` its memory of
earlier runs, and ``Tuned`` the choice by shape that ``kernels.attention`` and
``kernels.linear_cross_entropy`` take as their ``impl``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from . import attention, linear_cross_entropy

SLOWER_THAN_NAMED = 2.0
"""A tier named in the recipe is used as named; a warning says so when it measured more than
this many times slower than the fastest that fits."""

REPEATS = 3
"""Timed runs of each tier at each shape (after one that compiles it): the median counts."""

LOST_BY = 2.0
"""A tier whose first timed run at a shape took more than this many times the fastest tier's
time there so far is not run again: its one time stands (it cannot win), and measuring costs
less where a tier is far behind."""

EDGE = 0.05
"""The static default (the tier a run takes without measuring) keeps a shape unless another
tier measured more than this much faster there. An op timed alone predicts its share of a whole
step to a few percent (session 33's benches: a step's tiers agreed with their op times only
beyond that), so a near tie is no reason to leave the default."""

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass(frozen=True)
class Case:
    """One shape at which a run calls an op."""

    op: str
    """"attention" or "loss"."""
    dims: tuple[int, ...]
    """attention: (rows, query heads, key/value heads, positions, head dim); loss: (tokens,
    vocabulary, hidden)."""
    dtype: str
    """The step's dtype: float32, bfloat16 or float16."""
    segments: bool = False
    """attention: packed rows, whose segment ids keep their sequences apart."""
    head_grad: bool = True
    """loss: the LM head trains (its gradient is taken)."""

    @property
    def size(self) -> int:
        """What a call's shape is matched on: positions a row (attention), tokens (loss)."""
        return self.dims[3] if self.op == "attention" else self.dims[0]

    def label(self) -> str:
        if self.op == "attention":
            b, hq, hkv, t, d = self.dims
            extra = ", packed" if self.segments else ""
            return f"attention T={t} B={b} H={hq}/{hkv} D={d} {self.dtype}{extra}"
        n, v, d = self.dims
        extra = "" if self.head_grad else ", head frozen"
        return f"loss N={n} V={v} D={d} {self.dtype}{extra}"

    def key(self) -> str:
        """The cache's key of this shape."""
        flags = ("s" if self.segments else "") + ("" if self.head_grad else "f")
        return f"{self.op}:{'x'.join(map(str, self.dims))}:{self.dtype}:{flags}"


@dataclass(frozen=True)
class Timed:
    """One tier at one case: its median seconds (None: not timed), the step's estimated peak
    with it, and a note (cached, over the budget, failed: ...)."""

    tier: str
    seconds: float | None
    peak: float
    note: str = ""


@dataclass(frozen=True)
class Decision:
    """The tier a case runs in, every tier's row, and why."""

    case: Case
    tier: str
    rows: tuple[Timed, ...]
    why: str

    def seconds(self, tier: str) -> float | None:
        return next((r.seconds for r in self.rows if r.tier == tier), None)

    def to_dict(self) -> dict:
        return {
            "shape": self.case.label(),
            "chosen": self.tier,
            "why": self.why,
            "ms": {
                r.tier: None if r.seconds is None else round(1e3 * r.seconds, 3) for r in self.rows
            },
            "notes": {r.tier: r.note for r in self.rows if r.note},
        }


def decide(
    case: Case,
    tiers: Iterable[str],
    seconds_of: Callable[[str, Case], float],
    peak_of: Callable[[str, Case], float],
    budget: float,
    named: str | None = None,
    default: str | None = None,
) -> Decision:
    """The tier ``case`` runs in. Each tier's step peak (``peak_of``) is weighed against
    ``budget`` first: one over it is never timed nor chosen. The others are timed
    (``seconds_of``; one that raises is passed over) and the fastest is taken, except that
    ``default`` (the tier the run takes unmeasured) is kept where it fits and is within EDGE of
    the fastest. When none fits (or none ran), the leanest is. ``named``: the tier the recipe
    names, taken as it is."""
    rows = []
    for tier in tiers:
        peak = float(peak_of(tier, case))
        if peak > budget:
            rows.append(Timed(tier, None, peak, "over the memory budget"))
            continue
        try:
            rows.append(Timed(tier, float(seconds_of(tier, case)), peak))
        except Exception as e:  # a tier that cannot run this shape here
            rows.append(Timed(tier, None, peak, f"failed: {str(e).splitlines()[0][:200]}"))
    if not rows:
        raise ValueError(f"no tier to choose from for {case.label()}")
    timed = [r for r in rows if r.seconds is not None]
    if named is not None:
        fastest = min(timed, key=lambda r: r.seconds) if timed else None
        mine = next((r.seconds for r in rows if r.tier == named), None)
        why = "named in the recipe"
        if fastest is not None and mine is not None and mine > SLOWER_THAN_NAMED * fastest.seconds:
            why += f"; {mine / fastest.seconds:.1f}x slower than {fastest.tier} here"
        return Decision(case, named, tuple(rows), why)
    if timed:
        best = min(timed, key=lambda r: r.seconds)
        mine = next((r.seconds for r in timed if r.tier == default), None)
        if best.tier != default and mine is not None and mine <= (1 + EDGE) * best.seconds:
            why = f"the default: within {EDGE:.0%} of the fastest that fits ({best.tier})"
            return Decision(case, default, tuple(rows), why)
        return Decision(case, best.tier, tuple(rows), "the fastest that fits")
    lean = min(rows, key=lambda r: r.peak)
    return Decision(case, lean.tier, tuple(rows), "the leanest: no tier's step fits or ran")


class Tuned:
    """An op's tier by shape, as measured: what ``impl`` takes where the choice was ``auto``.
    A call runs in the tier of the smallest measured shape at least its own (positions a row
    for attention, tokens for the loss), else the largest's."""

    def __init__(self, op: str, decisions: Iterable[Decision]):
        self.op = op
        self.decisions = sorted(decisions, key=lambda d: d.case.size)
        if not self.decisions:
            raise ValueError(f"no measured shape for {op}")

    def tier_at(self, size: int) -> str:
        for d in self.decisions:
            if size <= d.case.size:
                return d.tier
        return self.decisions[-1].tier

    @property
    def tiers(self) -> set[str]:
        """Every tier some shape runs in."""
        return {d.tier for d in self.decisions}

    def __str__(self) -> str:
        parts, last = [], None
        for d in self.decisions:
            if d.tier != last:
                parts.append(f"{d.tier} from {d.case.size}" if parts else d.tier)
            last = d.tier
        return "measured: " + ", ".join(parts)

    def __repr__(self) -> str:
        return f"Tuned({self.op!r}, {str(self)!r})"


def tier_at(tier, size: int) -> str:
    """The tier a kernel choice runs a call of ``size`` in (positions a row for attention,
    tokens for the loss): a measured choice (``Tuned``) by size, else the tier itself."""
    return tier.tier_at(size) if isinstance(tier, Tuned) else tier


# ---------------------------------------------------------------------- the clock


def _inputs(case: Case):
    """Random inputs of the case's shapes and dtype, and the function whose forward and
    backward are timed (given the tier)."""
    dtype = _DTYPES[case.dtype]
    keys = mx.random.split(mx.random.key(7), 4)
    if case.op == "attention":
        b, hq, hkv, t, d = case.dims
        q = mx.random.normal((b, hq, t, d), key=keys[0]).astype(dtype)
        k = mx.random.normal((b, hkv, t, d), key=keys[1]).astype(dtype)
        v = mx.random.normal((b, hkv, t, d), key=keys[2]).astype(dtype)
        seg = None
        if case.segments:  # two sequences a row
            seg = (mx.arange(t)[None, :] >= t // 2).astype(mx.int32) + mx.zeros((b, 1), mx.int32)

        def make(tier):
            def f(q, k, v):
                out = attention(q, k, v, scale=d**-0.5, causal=True, segment_ids=seg, impl=tier)
                return out.astype(mx.float32).sum()

            return mx.value_and_grad(f, argnums=(0, 1, 2)), (q, k, v)

        return make
    n, vocab, d = case.dims
    h = mx.random.normal((n, d), key=keys[0]).astype(dtype)
    w = (0.05 * mx.random.normal((vocab, d), key=keys[1])).astype(dtype)
    targets = mx.random.randint(0, vocab, (n,), key=keys[2])

    def make(tier):
        def f(h, w):
            loss, _ = linear_cross_entropy(h, w, targets, impl=tier, weight_grad=case.head_grad)
            return loss

        argnums = (0, 1) if case.head_grad else 0
        return mx.value_and_grad(f, argnums=argnums), (h, w)

    return make


def time_case(
    tier: str,
    case: Case,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
    bound: float | None = None,
) -> float:
    """Median seconds of the case's forward and backward in ``tier``, compiled, after one run
    that compiles it; the first timed run alone where it took longer than ``bound`` seconds."""
    fn, args = _inputs(case)(tier)
    step = mx.compile(fn)
    mx.eval(step(*args))
    times = []
    for _ in range(repeats):
        start = clock()
        mx.eval(step(*args))
        times.append(clock() - start)
        if bound is not None and times[0] > bound:
            break
    del step
    mx.clear_cache()
    return statistics.median(times)


# ---------------------------------------------------------------------- the cache


def device_name() -> str:
    """The device the times hold for: the default device's kind, its name, and on the CPU the
    number of cores."""
    dev = mx.default_device()
    try:
        name = str(mx.device_info().get("device_name", ""))
    except Exception:  # a backend without device_info
        name = ""
    name = name or platform.processor() or platform.machine()
    kind = "gpu" if dev.type == mx.DeviceType.gpu else "cpu"
    return f"{kind}: {name}" + (f" ({os.cpu_count()} cores)" if kind == "cpu" else "")


def sources_fingerprint() -> str:
    """A hash of the kernels' own sources (this package and the GPU kernel bodies): times
    measured under other sources are not used."""
    here = Path(__file__).resolve().parent
    bodies = here.parent / "metal_kernels"
    if not bodies.is_dir():  # a checkout: the kernel bodies sit beside the package
        bodies = here.parent.parent / "metal_kernels"
    files = sorted(here.glob("*.py"))
    if bodies.is_dir():
        files += sorted(p for p in bodies.rglob("*") if p.suffix in (".body", ".h"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def cache_path() -> Path:
    """Where measured times are kept: the file ``$MLXTUNE_KERNEL_TIMES`` names, else
    ``$MLXTUNE_CACHE/kernel-times.json``, else under ``~/.cache/mlxtune`` (XDG's cache folder
    where ``XDG_CACHE_HOME`` is set), beside the data cache."""
    if os.environ.get("MLXTUNE_KERNEL_TIMES"):
        return Path(os.environ["MLXTUNE_KERNEL_TIMES"])
    if os.environ.get("MLXTUNE_CACHE"):
        return Path(os.environ["MLXTUNE_CACHE"]) / "kernel-times.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlxtune" / "kernel-times.json"


class TimeCache:
    """Times measured on earlier runs, by device; a device's entry holds for one MLX version
    and one set of kernel sources (``sources_fingerprint``), and is dropped when either
    changes. A file that cannot be read is started afresh; one that cannot be written is left
    as it was (the run goes on, timing again next time)."""

    def __init__(self, path: Path | None = None, device: str | None = None):
        self.path = Path(path) if path is not None else cache_path()
        self.device = device or device_name()
        self.stamp = {"mlx": mx.__version__, "kernels": sources_fingerprint()}
        self._all = self._read()
        entry = self._all.get(self.device)
        if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in self.stamp.items()):
            entry = {**self.stamp, "times": {}}
        self._entry = entry
        self.dirty = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def seconds(self, case: Case, tier: str) -> float | None:
        value = self._entry["times"].get(case.key(), {}).get(tier)
        return float(value) if isinstance(value, (int, float)) else None

    def record(self, case: Case, tier: str, seconds: float) -> None:
        self._entry["times"].setdefault(case.key(), {})[tier] = seconds
        self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        data = {**self._read(), self.device: self._entry}
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".kernel-times.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            self.dirty = False


def cached_clock(cache: TimeCache, clock=None) -> Callable[[str, Case], float]:
    """``clock`` (``time_case`` unless given) through ``cache``: a time measured before is
    read back, a new one kept. Each case's fastest time so far bounds the next tier's repeats
    (``LOST_BY``). The returned function's ``hits`` counts what was read back."""
    fastest: dict[str, float] = {}

    def seconds_of(tier: str, case: Case) -> float:
        known = cache.seconds(case, tier)
        if known is None:
            best = fastest.get(case.key())
            bound = None if best is None else LOST_BY * best
            known = (clock or time_case)(tier, case, bound=bound)
            cache.record(case, tier, known)
        else:
            seconds_of.hits += 1
        fastest[case.key()] = min(known, fastest.get(case.key(), known))
        return known

    seconds_of.hits = 0
    return seconds_of
