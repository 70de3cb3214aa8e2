"""What a run carries from one step to the next beyond the weights and the optimizer's arrays:
where the loop is (``LoopPosition``) and the engine's host-side state (``EngineState``). A
checkpoint saves both as one ``TrainState`` (the ``resume`` section of trainer_state.json), and
a resumed run reads it back whole."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields


@dataclass
class Window:
    """Sums over the steps since the last metrics row."""

    loss: float = 0.0
    """Summed loss of the applied steps."""
    n: int = 0
    """What the loss counted (for SFT its target tokens) in the applied steps."""
    timed_n: int = 0
    """Target tokens of the steps whose time is in ``time`` (the compiling step's are not)."""
    time: float = 0.0
    steps: int = 0
    """Steps timed."""
    real: int = 0
    """Tokens the batches held, and the slots they filled padding included
    (packing_utilization)."""
    room: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    """Sums of the objective's own metrics."""
    host: dict[str, list[float]] = field(default_factory=dict)
    """The objective's host-made metrics: name -> [sum, weight] (``Objective.host_metrics``)."""

    def to_json(self) -> dict:
        out = asdict(self)
        for k in ("metrics", "host"):  # a checkpoint of an objective without them reads as before
            if not out[k]:
                del out[k]
        return out

    @classmethod
    def from_json(cls, d: dict | None) -> Window:
        return cls(**(d or {}))


@dataclass
class LoopPosition:
    """Where the loop is: enough to continue exactly from here."""

    step: int = 0
    data_epoch: int = 0
    """The epoch of the data order the next batch comes from, and how many of its batches
    were taken."""
    data_batch: int = 0
    data_stream: dict | None = None
    """A streamed training set (data.streaming): where the next batch comes from in it
    (``StreamState.to_json``)."""
    tokens_seen: int = 0
    """Counted tokens of the applied steps."""
    examples_seen: int = 0
    window: Window = field(default_factory=Window)
    best_eval: float = math.inf
    best_watched: float | None = None
    """The best value of the watched metric (train.early_stopping.metric) so far."""
    stalled: int = 0
    """Evaluations in a row since it last improved by more than early stopping's min_delta."""
    last_loss: float = math.nan
    first_row: bool = True
    """The next metrics row is the run's first (it carries the compile time)."""


@dataclass
class EngineState:
    """The engine's host-side state: the loss scaler, the non-finite counters, the
    micro-batch split an out-of-memory step chose, and the random state."""

    scale: float | None = None
    """The loss scale (None: the recipe's initial scale)."""
    good: int = 0
    """Finite steps since the scale last changed."""
    skipped: int = 0
    """Steps whose update was not applied."""
    in_a_row: int = 0
    """Of those, the latest run of consecutive ones."""
    micro_split: int = 1
    rng: tuple[int, int] = (0, 0)
    """The random key as two 32-bit words."""


@dataclass
class TrainState:
    """A checkpoint's resume state: the loop's position and the engine's state."""

    position: LoopPosition
    engine: EngineState

    def to_json(self) -> dict:
        p, e = self.position, self.engine
        out = {f.name: getattr(p, f.name) for f in fields(p)}
        out["window"] = p.window.to_json()
        out["rng"] = list(e.rng)
        out["scaler"] = {"scale": e.scale, "good": e.good}
        out["nonfinite"] = {"skipped": e.skipped, "in_a_row": e.in_a_row}
        out["micro_split"] = e.micro_split
        return out

    @classmethod
    def from_json(cls, d: dict) -> TrainState:
        names = {f.name for f in fields(LoopPosition)} - {"window"}
        position = LoopPosition(
            **{k: d[k] for k in names if k in d}, window=Window.from_json(d.get("window"))
        )
        scaler, nf = d.get("scaler") or {}, d.get("nonfinite") or {}
        hi, lo = d["rng"]
        engine = EngineState(
            scale=float(scaler["scale"]) if "scale" in scaler else None,
            good=int(scaler.get("good", 0)),
            skipped=int(nf.get("skipped", 0)),
            in_a_row=int(nf.get("in_a_row", 0)),
            micro_split=int(d.get("micro_split", 1)),
            rng=(int(hi), int(lo)),
        )
        return cls(position, engine)
