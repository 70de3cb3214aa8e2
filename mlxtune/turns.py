"""Multi-turn decoding: rows that write a turn, hear an answer (a tool's result, an environment's
message) and write again, in one batched KV cache kept across turns.

A turn's answer is prefilled into the cache of the row that asked for it, not recomputed with
everything before it. Rows end their turns at different steps and get answers of different
lengths, so a row's cache has holes: the positions decoded past the end of its turn (the batch
went on for the others) and the left padding of the answer chunk. Holes are masked out of the
attention and skipped by the rotary positions (``gap``: a row's holes before the next position),
so each row's tokens see exactly the tokens of its transcript, at the positions they would have
read without holes. The last token of a turn is fed again at the head of its answer: the batch
may have stopped before feeding it.

Each row draws turn ``t`` from its own key (``turn_keys``), whatever rows it is batched with, so
a row's transcript does not depend on the batch (data parallelism, resumed runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .generate import (
    BLOCK,
    FixedKVCache,
    Sampling,
    StopStrings,
    decode_step,
    draw,
    grow_caches,
    own_caches,
    plain_kv_caches,
    prefill,
    token_logps,
)

Respond = Callable[[int, list[int], str, bool], "list[int] | None"]
"""``respond(row, turn_tokens, how, last)``: the context tokens that follow a row's turn (``how``:
"eos" or "stop"; ``last``: no turn may follow, whatever it returns), or None where its
conversation is over. A turn cut at a length limit is not answered."""


class TurnKVCache(FixedKVCache):
    """``FixedKVCache`` with holes: ``hole`` [B, S] marks the positions no token of the row's
    transcript holds (masked out), ``gap`` [B] counts a row's holes before the next position (its
    rotary position is the positions written less them)."""

    def __init__(self, keys, values, idx, hole, gap):
        self.keys, self.values, self.idx = keys, values, idx
        self.hole, self.gap = hole, gap

    @property
    def offset(self) -> mx.array:
        return self.idx - self.gap

    def make_mask(self, n: int, return_array: bool = False, **kwargs) -> mx.array:
        cols = mx.arange(self.keys.shape[2])
        causal = cols[None, :] <= (self.idx + mx.arange(n))[:, None]  # [n, S]
        return causal[None, None] & ~self.hole[:, None, None, :]  # [B, 1, n, S]


def turn_keys(keys: mx.array, turn: int) -> mx.array:
    """The rows' keys for ``turn``: turn 0 draws from the row's own key (as single-turn
    generation does), turn t from the t-th of its ``t + 1`` splits."""
    if turn == 0:
        return keys
    return mx.stack([mx.random.split(k, turn + 1)[turn] for k in keys])


@dataclass
class Transcript:
    """What a row wrote and read after its prompt: ``tokens``, ``written`` (1 where the model
    wrote the token, 0 where it was context), ``logps`` (each written token's log-probability
    under the logits it was drawn from, at temperature 1; 0 for context), its turns' token
    counts, and whether its last turn ended (at an end of turn or stop string: not cut at a
    length limit)."""

    tokens: list[int] = field(default_factory=list)
    written: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    ended: bool = False


@dataclass
class _Rows:
    """The batch's state between turns: each batch row's output row, the caches' buffers,
    positions written, the host's hole map and gaps, and where each row's turn ended."""

    rows: list[int]
    ks: list
    vs: list
    idx: int
    hole: np.ndarray
    gap: np.ndarray
    ends: list[int]
    logits: mx.array | None = None


def converse(
    model: nn.Module,
    prompts: list[list[int]],
    group: int,
    keys: mx.array,
    sampling: Sampling,
    eos: set[int],
    turn_tokens: int,
    budget: int,
    respond: Respond,
    max_turns: int,
    *,
    stop: StopStrings | None = None,
    reuse: bool = True,
) -> list[Transcript]:
    """``group`` conversations from each prompt (prompt-major, ``keys`` one a row): each turn
    decodes every live row up to its end of turn (``eos``, kept as the turn's last token), a
    ``stop`` string, or ``turn_tokens``; ``respond`` gives each the context that follows, which
    is prefilled into its cache (``reuse``; else each turn reads the whole transcript afresh, to
    measure against). Models whose caches are not plain KV caches (sliding windows, recurrent
    state) read each turn's whole transcript afresh into their own caches. A conversation ends
    when ``respond`` gives None, after ``max_turns`` turns, or when the next context and one
    more token would pass ``budget`` tokens after the prompt (then its last turn counts as
    cut)."""
    n = len(prompts) * group
    out = [Transcript() for _ in range(n)]
    base = [p for p in prompts for _ in range(group)]
    live = list(range(n))
    was = model.training
    model.eval()
    own = not plain_kv_caches(model)
    try:
        state = None
        pending: dict[int, list[int]] = {}
        for turn in range(max_turns):
            ks = turn_keys(keys[mx.array(live)], turn)
            caps = [min(turn_tokens, budget - len(out[r].tokens)) for r in live]
            seqs = [base[r] + out[r].tokens for r in live]
            if own:
                rows = list(live)
                drawn, how, lps = _own_turn(model, seqs, ks, sampling, eos, stop, caps)
            else:
                if turn == 0 or not reuse:
                    first = turn == 0
                    state = _fresh(model, seqs, prompts if first else None, group if first else 1)
                    state.rows = list(live)
                else:
                    _append(model, state, live, [pending[r] for r in live])
                drawn, how, lps = _decode_turn(model, state, ks, sampling, eos, stop, caps)
                rows = state.rows
            nxt, pending = [], {}
            for j, r in enumerate(rows):
                t = out[r]
                t.tokens += drawn[j]
                t.written += [1] * len(drawn[j])
                t.logps += lps[j]
                t.turns.append(len(drawn[j]))
                t.ended = how[j] != "cut"
                if how[j] == "cut":
                    continue
                ctx = respond(r, drawn[j], how[j], turn == max_turns - 1)
                if ctx is None or turn == max_turns - 1:
                    continue
                if len(t.tokens) + len(ctx) + 1 > budget:
                    t.ended = False
                    continue
                t.tokens += ctx
                t.written += [0] * len(ctx)
                t.logps += [0.0] * len(ctx)
                nxt.append(j)
                pending[r] = [drawn[j][-1], *ctx]
            if not nxt:
                break
            live = [rows[j] for j in nxt]
            if reuse and not own:
                _keep(state, nxt)
    finally:
        model.train(was)
    return out


def _fresh(model, seqs, prompts, group) -> _Rows:
    """Rows read from scratch: ``prompts`` x ``group`` (the first turn, each prompt read once),
    or ``seqs`` one a row."""
    logits, ks, vs, left, shift, cap = prefill(model, prompts or seqs, group)
    width = max(len(p) for p in (prompts or seqs))
    left = np.array(left)
    hole = np.zeros((len(left), cap), bool)
    for j, k in enumerate(left):
        hole[j, :k] = True
    return _Rows([], ks, vs, width, hole, left.astype(np.int32), [width] * len(left), logits)


def _keep(state: _Rows, take: list[int]) -> None:
    """The batch cut to the rows ``take`` (batch positions)."""
    sel = mx.array(take)
    state.rows = [state.rows[j] for j in take]
    state.ks, state.vs = [k[sel] for k in state.ks], [v[sel] for v in state.vs]
    state.hole, state.gap = state.hole[take], state.gap[take]
    state.ends = [state.ends[j] for j in take]


def _append(model, state: _Rows, live: list[int], chunks: list[list[int]]) -> None:
    """Each row's context (its turn's last token first) prefilled at the batch's next position,
    right-aligned: the positions past the row's turn and the chunk's left padding become holes.
    Leaves the logits of each row's last position."""
    width = max(len(c) for c in chunks)
    idx = state.idx
    cap = state.hole.shape[1]
    need = -(-(idx + width + 1) // BLOCK) * BLOCK
    if need > cap:
        state.ks, state.vs = grow_caches(state.ks, state.vs, need)
        state.hole = np.pad(state.hole, [(0, 0), (0, need - cap)])
    x = np.zeros((len(chunks), width), np.int32)
    for j, c in enumerate(chunks):
        pad = width - len(c)
        state.hole[j, state.ends[j] : idx + pad] = True
        state.gap[j] += idx - state.ends[j] + pad
        x[j, pad:] = c
    caches = [
        TurnKVCache(k, v, mx.array([idx], mx.int32), mx.array(state.hole), mx.array(state.gap))
        for k, v in zip(state.ks, state.vs, strict=True)
    ]
    x = mx.array(x)
    if width > 1 and hasattr(model, "model"):
        model.model(x[:, :-1], cache=caches)
        x = x[:, -1:]
    state.logits = model(x, cache=caches)[:, -1, :].astype(mx.float32)
    state.ks, state.vs = [c.keys for c in caches], [c.values for c in caches]
    state.idx = idx + width


def _turn_end(drawn: list[int], eos, stop, cap: int) -> str:
    """How a turn whose tokens so far are ``drawn`` ends with its last one: "eos", "stop",
    "cut" (at ``cap`` tokens), or "" (it goes on)."""
    if drawn[-1] in eos:
        return "eos"
    if stop is not None and stop.ends(drawn):
        return "stop"
    return "cut" if len(drawn) >= cap else ""


def _own_turn(model, seqs, keys, s, eos, stop, caps):
    """One turn of rows whose caches are the model's own (sliding windows, conv or SSM state):
    each row's whole transcript read afresh into them, rows of one length together (padding
    would flow into a recurrent state), one uncompiled step a token, each row drawing from its
    own key as in the batched cache: (each row's tokens, how its turn ended, their log-probs)."""
    drawn: list[list[int]] = [[] for _ in seqs]
    lps: list[list[float]] = [[] for _ in seqs]
    how = [""] * len(seqs)
    by_length: dict[int, list[int]] = {}
    for i, q in enumerate(seqs):
        by_length.setdefault(len(q), []).append(i)
    for idx in by_length.values():
        cache = own_caches(model)
        logits = model(mx.array([seqs[i] for i in idx]), cache=cache)[:, -1, :]
        logits = logits.astype(mx.float32)
        ks = keys[mx.array(idx)]
        while True:
            tokens, ks = draw(logits, ks, s)
            lp = token_logps(logits, tokens).tolist()
            for j, t in enumerate(tokens.tolist()):
                i = idx[j]
                if not how[i]:
                    drawn[i].append(t)
                    lps[i].append(lp[j])
                    how[i] = _turn_end(drawn[i], eos, stop, caps[i])
            if all(how[i] for i in idx):
                break
            logits = model(tokens[:, None], cache=cache)[:, -1, :].astype(mx.float32)
    return drawn, how, lps


def _decode_turn(model, state: _Rows, keys, s, eos, stop, caps):
    """One turn of every row in the batch: (each row's tokens, how its turn ended). Rows stay in
    the batch until the last ends (their caches are kept for the next turn)."""
    rows = len(state.rows)
    step = decode_step(model, TurnKVCache)
    hole, gap = mx.array(state.hole), mx.array(state.gap)
    idx = mx.array([state.idx], mx.int32)
    start = state.idx
    drawn: list[list[int]] = [[] for _ in range(rows)]
    lps: list[list[float]] = [[] for _ in range(rows)]
    how = [""] * rows
    tokens, keys = draw(state.logits, keys, s)
    ks, vs, pos, cap = state.ks, state.vs, state.idx, state.hole.shape[1]
    pending = [(tokens, token_logps(state.logits, tokens))]
    while True:
        got, lp = pending.pop(0)
        lp = lp.tolist()
        for j, t in enumerate(got.tolist()):
            if how[j]:
                continue
            drawn[j].append(t)
            lps[j].append(lp[j])
            how[j] = _turn_end(drawn[j], eos, stop, caps[j])
        if all(how):
            break
        while len(pending) < 2:
            if pos == cap:
                cap += BLOCK
                ks, vs = grow_caches(ks, vs, cap)
                hole = mx.pad(hole, [(0, 0), (0, BLOCK)])
            caches, ks, vs = (ks, vs), None, None
            z, ks, vs, idx = step(tokens, *caches, idx, hole, gap)
            del caches
            tokens, keys = draw(z, keys, s)
            lp = token_logps(z, tokens)
            mx.async_eval(tokens, keys, ks, vs, idx, lp)
            pending.append((tokens, lp))
            pos += 1
    mx.eval(ks, vs)
    state.ks, state.vs, state.idx = ks, vs, pos
    if cap > state.hole.shape[1]:
        state.hole = np.pad(state.hole, [(0, 0), (0, cap - state.hole.shape[1])])
    # the tokens before a turn's last are in the cache; the last is fed again with the context
    state.ends = [start + len(d) - 1 for d in drawn]
    return drawn, how, lps


__all__ = ["Respond", "Transcript", "TurnKVCache", "converse", "turn_keys"]
