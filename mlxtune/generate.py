"""Decoding, for samples, the exact-match metric, reinforcement learning and ``generate``: prompts
of any lengths in one left-padded batch, each prompt read once (mlx-lm's batched KV cache) for
all its completions, then compiled decode steps of fixed shapes over fixed-capacity caches,
greedy or sampled (temperature, top-k, top-p, min-p) with a key of each row's own."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from .kernels.cpu import exp_of_nonpositive, materialized
from .models import VisionLM
from .models import images as image_inputs


def eos_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: greedy at temperature 0, else from the softmax of the
    logits / temperature, kept to the ``top_k`` likeliest, the smallest set whose probability
    reaches ``top_p``, and those at least ``min_p`` x the likeliest's probability (applied in
    that order, after the temperature, as Hugging Face's generate does)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def filtered_logits(logits: mx.array, s: Sampling) -> mx.array:
    """[B, V] fp32 logits / temperature, -inf outside the tokens ``s`` keeps."""
    z = logits.astype(mx.float32) / s.temperature
    neg = mx.array(-mx.inf, dtype=mx.float32)
    if 0 < s.top_k < z.shape[-1]:
        kth = mx.sort(z, axis=-1)[:, -s.top_k][:, None]
        z = mx.where(z >= kth, z, neg)
    if s.top_p < 1.0:
        order = mx.argsort(-z, axis=-1)
        desc = mx.take_along_axis(z, order, axis=-1)
        probs = mx.softmax(desc, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # probability of the likelier tokens
        # the likeliest token always stays; a token stays while the ones before it fall short
        keep = (before < s.top_p) | (mx.arange(z.shape[-1]) == 0)
        cutoff = mx.min(mx.where(keep, desc, mx.inf), axis=-1, keepdims=True)
        z = mx.where(z >= cutoff, z, neg)
    if s.min_p > 0.0:
        probs = mx.softmax(z, axis=-1)
        z = mx.where(probs >= s.min_p * mx.max(probs, axis=-1, keepdims=True), z, neg)
    return z


_LEADERS: list = []
"""The group whose rank 0 draws every token (``led_by_rank0``), innermost last."""


@contextlib.contextmanager
def led_by_rank0(group):
    """Every rank of ``group`` decodes in step with its rank 0: each token drawn is rank 0's
    (one small all-reduce a token). A fully sharded model gathers its blocks in every forward,
    so every rank must make the same calls; ranks whose arithmetic differs in the last bit
    (other machines) would otherwise draw other tokens, end at other steps and leave a
    collective unanswered."""
    _LEADERS.append(group)
    try:
        yield
    finally:
        _LEADERS.pop()


def _led(tokens: mx.array) -> mx.array:
    """``tokens``, or rank 0's inside ``led_by_rank0``."""
    if not _LEADERS:
        return tokens
    group = _LEADERS[-1]
    # the same graph on every rank (zeros computed from its own tokens, not made apart): the
    # ranks then order this collective and the blocks' gathers alike
    mine = tokens.astype(mx.int32) * int(group.rank() == 0)
    return mx.distributed.all_sum(mine, group=group).astype(tokens.dtype)


def draw(logits: mx.array, keys: mx.array, s: Sampling) -> tuple[mx.array, mx.array]:
    """(tokens [B], the rows' next keys): greedy, or the inverse of each row's CDF over the
    filtered softmax at one uniform from the row's own key (so a row draws what it would draw
    in any other batch)."""
    if s.temperature <= 0:
        return _led(mx.argmax(logits, axis=-1)), keys
    tokens, keys = _sampler(s)(logits, keys)
    return _led(tokens), keys


@lru_cache(maxsize=32)
def _sampler(s: Sampling):
    """The compiled draw of ``s``: one random number a row (not one a vocabulary entry, as
    Gumbel-max takes), the exponentials in fused arithmetic on the CPU (``kernels.cpu``), a
    running sum, and the first token whose sum passes the row's uniform x the total (so the
    probabilities need no normalising; a token kept out adds 0, so never passes)."""

    def draw(logits, keys):
        pairs = mx.vmap(lambda k: mx.random.split(k))(keys)  # [B, 2, 2]
        u = mx.vmap(lambda k: mx.random.uniform(key=k))(pairs[:, 1])  # [B] in [0, 1)
        z = filtered_logits(logits, s)
        e = exp_of_nonpositive(materialized(z - z.max(axis=-1, keepdims=True)))
        cdf = mx.cumsum(e, axis=-1)
        return mx.argmax(cdf > (u * cdf[:, -1])[:, None], axis=-1), pairs[:, 0]

    return mx.compile(draw)


class StopStrings:
    """Strings that end a completion: ``ends(ids)`` is True once the decoded completion holds
    one of them (decoding only its last tokens: a token is at least one character)."""

    def __init__(self, tokenizer, strings):
        self.tokenizer = tokenizer
        self.strings = [x for x in strings if x]
        self._tail = 2 * max((len(x) for x in self.strings), default=0) + 2

    def ends(self, ids: list[int]) -> bool:
        if not self.strings:
            return False
        text = self.tokenizer.decode(ids[-self._tail :])
        return any(x in text for x in self.strings)

    def found(self, text: str) -> bool:
        return any(x in text for x in self.strings)


def row_keys(seed: int, prompts: int, group: int = 1) -> mx.array:
    """The sampling keys of ``prompts`` x ``group`` rows (prompt-major): sample j of prompt i
    draws from key j of prompt i's split, whatever else is generated with it."""
    return mx.concatenate([mx.random.split(mx.random.key(seed + i), group) for i in range(prompts)])


def generate_ids(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    temperature: float = 0.0,
    seed: int = 0,
    max_batch: int = 64,
    *,
    sampling: Sampling | None = None,
    group: int = 1,
    keys: mx.array | None = None,
    stop: StopStrings | None = None,
    on_token=None,
    on_logits=None,
    images: list | None = None,
    logps: list | None = None,
) -> list[list[int]]:
    """New token ids (without the prompt, EOS left out) of ``group`` completions of each prompt,
    prompt-major. Prompts of any lengths decode together, left-padded in one batched KV cache;
    each prompt is read once and its cache copied to its ``group`` rows. Rows stop at EOS and
    leave the batch. ``sampling`` (default: ``temperature`` alone) draws each row from its own
    key (``keys`` [rows, 2], default ``row_keys(seed, ...)``). ``stop`` also ends a row at the
    token that completes one of its strings (that token kept). ``on_token(row, token)`` hears
    each new token as it is drawn (streaming). ``on_logits(rows, logits)`` sees the fp32 logits
    each token is drawn from ([batch rows, vocab]; ``rows[j]`` is batch row j's output row, -1
    once it has finished; the batch is the call's prompts x ``group`` until rows finish).
    ``images``: a vision model's prompts' image files (a list of paths a prompt), which its
    image tokens show. ``logps``: a list that gets each row's drawn tokens' log-probabilities
    under the logits they were drawn from, at temperature 1 (``token_logps``; EOS included where
    a row ended at it)."""
    s = sampling or Sampling(temperature=temperature)
    keys = keys if keys is not None else row_keys(seed, len(prompts), group)
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    decode = _decode if plain_kv_caches(model) else _decode_own_caches
    try:
        step = max(1, max_batch // group)
        for at in range(0, len(prompts), step):
            chunk = prompts[at : at + step]
            ks = keys[at * group : (at + len(chunk)) * group]
            hear = see = None
            base = at * group
            if on_token is not None:
                hear = lambda r, t, base=base: on_token(base + r, t)  # noqa: E731
            if on_logits is not None:
                see = lambda rs, z, base=base: on_logits(  # noqa: E731
                    [r + base if r >= 0 else r for r in rs], z
                )
            shown = {} if images is None else {"images": images[at : at + step]}
            got = [] if logps is not None else None
            out += decode(
                model, chunk, max_new_tokens, eos, s, group, ks, stop, hear, see, got, **shown
            )
            if logps is not None:
                logps += got
    finally:
        model.train(was_training)
    return out


def token_logps(logits: mx.array, tokens: mx.array) -> mx.array:
    """[B] each row's ``tokens`` log-probability under its fp32 ``logits`` (temperature 1, no
    filtering: the distribution the training forward scores)."""
    picked = mx.take_along_axis(logits, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    return picked - mx.logsumexp(logits, axis=-1)


def _ends(row: list[int], token: int, r: int, eos, stop, on_token) -> bool:
    """Take ``token`` drawn for output row ``r`` (its tokens so far ``row``): whether the row
    ends with it (EOS, left out; a stop string, kept)."""
    if token in eos:
        return True
    row.append(token)
    if on_token is not None:
        on_token(r, token)
    return stop is not None and stop.ends(row)


def own_caches(model) -> list:
    """The model's own per-layer caches, as mlx-lm makes them for it."""
    return model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]


def plain_kv_caches(model) -> bool:
    """Whether every layer of the model caches plain keys and values (mlx-lm's KVCache): then
    prompts decode left-padded in fixed-capacity caches. Sliding windows (rotating caches) and
    recurrent layers (conv or SSM state) decode in the model's own caches instead."""
    return all(type(c) is KVCache for c in own_caches(model))


def _batch_cache(model, pad: list[int]) -> list:
    """The model's per-layer caches as mlx-lm's batched, left-padded KV caches."""
    return [BatchKVCache(pad) for _ in own_caches(model)]


def _decode_own_caches(
    model,
    prompts,
    max_new_tokens,
    eos,
    s,
    group,
    keys,
    stop=None,
    on_token=None,
    on_logits=None,
    logps=None,
    images=None,
) -> list[list[int]]:
    """``_decode`` for models whose caches are not plain KV caches (sliding windows, conv or
    SSM state): prompts of one length at a time, unpadded (padding would flow into a recurrent
    state), each prompt's ``group`` rows read it in one batch, in the model's own caches
    (``make_cache``), one uncompiled step a token. Rows draw from the same keys as ``_decode``
    gives them, so a row's tokens do not depend on which path decodes it. A vision model's
    prompts read their ``images`` (the prompts' files)."""
    new: list[list[int]] = [[] for _ in range(len(prompts) * group)]
    if logps is not None:
        logps += [[] for _ in new]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    for idx in by_length.values():
        rows = [i * group + j for i in idx for j in range(group)]
        read = [prompts[i] for i in idx for _ in range(group)]
        shown = None
        if images is not None and isinstance(model, VisionLM):
            files = [[Path(f) for f in images[i]] for i in idx for _ in range(group)]
            shown, shift = model.prompt_arrays(read, files)
            if any(shift):  # positions the caches' offsets do not give
                raise ValueError("prompts whose rotary positions shift decode in _decode")
        cache = own_caches(model)
        with image_inputs(shown):
            logits = model(mx.array(read), cache=cache)[:, -1, :].astype(mx.float32)
        ks = keys[mx.array(rows)]
        done = [False] * len(rows)
        for t in range(max_new_tokens):
            tokens, ks = draw(logits, ks, s)
            if on_logits is not None:
                on_logits([r if not done[j] else -1 for j, r in enumerate(rows)], logits)
            lps = token_logps(logits, tokens).tolist() if logps is not None else None
            for j, tok in enumerate(tokens.tolist()):
                if not done[j]:
                    if lps is not None:
                        logps[rows[j]].append(lps[j])
                    done[j] = _ends(new[rows[j]], tok, rows[j], eos, stop, on_token)
            if all(done) or t == max_new_tokens - 1:
                break
            logits = model(tokens[:, None], cache=cache)[:, -1, :].astype(mx.float32)
    return new


AHEAD = 4
"""Decode steps queued on the device before the host reads the oldest one's tokens: the host's
checks (EOS, stop strings, streaming) never leave the device waiting; a batch whose rows have
all ended computes at most this many steps more."""

BLOCK = 256
"""Positions a decode step's KV cache grows by: its capacity is a multiple of this, so the compiled
steps have shapes from a short list."""


class FixedKVCache:
    """One layer's batched, left-padded KV cache of a fixed capacity, for compiled decode steps: a
    step writes its keys and values at ``idx`` and attends over the whole buffer, positions of the
    left padding and those not written yet masked out, so every step reads and writes arrays of
    the same shapes. The interface mlx-lm's attention layers call (``offset``,
    ``update_and_fetch``, ``make_mask``)."""

    def __init__(
        self,
        keys: mx.array,
        values: mx.array,
        idx: mx.array,
        left: mx.array,
        shift: mx.array,
    ):
        self.keys, self.values = keys, values
        self.idx = idx
        """[1] int32: the next position to write."""
        self.left = left
        """[B] int32: each row's left padding."""
        self.shift = shift
        """[B] int32: each row's rotary shift (0 but for a vision model's prompt, whose image
        tokens take fewer positions than tokens)."""

    @property
    def offset(self) -> mx.array:
        """Each row's position (what RoPE reads): positions written less its padding, plus its
        shift."""
        return self.idx - self.left + self.shift

    def update_and_fetch(self, keys, values):
        self.keys = mx.slice_update(self.keys, keys, self.idx, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.idx, axes=(2,))
        self.idx = self.idx + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, **kwargs) -> mx.array:
        cols = mx.arange(self.keys.shape[2])
        causal = cols[None, :] <= (self.idx + mx.arange(n))[:, None]  # [n, S]
        return causal[None, None] & (self.left[:, None, None, None] <= cols)  # [B, 1, n, S]


class _Steps:
    """A model's compiled decode steps by kind (an attribute of the model, not one of its
    arrays)."""

    def __init__(self):
        self.steps: dict = {}


def decode_step(model, cache_class):
    """The model's compiled forward step over ``cache_class`` caches: (tokens [B], the caches'
    keys and values, idx, then what else each cache takes) -> fp32 last-position logits, the new
    keys and values, idx + 1. The model's weights are read at each call (training changes them
    between calls). The draw stays outside: compiled, its elementwise work ran slower on the
    CPU."""
    kept = model.__dict__.get("_mlxtune_steps")
    if kept is None:
        kept = _Steps()
        object.__setattr__(model, "_mlxtune_steps", kept)
    if cache_class not in kept.steps:

        def step(tokens, ks, vs, idx, *rest):
            caches = [cache_class(k, v, idx, *rest) for k, v in zip(ks, vs, strict=True)]
            logits = model(tokens[:, None], cache=caches)[:, -1, :].astype(mx.float32)
            return logits, [c.keys for c in caches], [c.values for c in caches], idx + 1

        kept.steps[cache_class] = mx.compile(step, inputs=[model.state])
    return kept.steps[cache_class]


def grow_caches(ks: list, vs: list, to: int) -> tuple[list, list]:
    """The caches' buffers zero-padded to ``to`` positions."""

    def pad(a):
        return mx.pad(a, [(0, 0), (0, 0), (0, to - a.shape[2]), (0, 0)])

    return [pad(k) for k in ks], [pad(v) for v in vs]


def prefill(model, prompts, group: int, images=None):
    """The prompts read left-padded into mlx-lm's batched cache, each once (all but the last
    position through the backbone alone: their cache, none of their [B, T, vocab] logits), then
    tiled ``group`` times: (the last position's fp32 logits, the caches' keys and values in
    fixed-capacity buffers, each row's left padding, each row's rotary shift, the buffers'
    capacity). A vision model's prompts read their ``images`` (the prompts' files) whole."""
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    cache = _batch_cache(model, pad)
    x = mx.array([[0] * k + p for k, p in zip(pad, prompts, strict=True)])
    shown, shift = None, [0] * len(prompts)
    if images is not None and isinstance(model, VisionLM):
        files = [[Path(f) for f in row] for row in images]
        shown, shift = model.prompt_arrays(prompts, files)
    if width > 1 and hasattr(model, "model"):
        model.model(x[:, :-1], cache=cache)
        x = x[:, -1:]
    with image_inputs(shown):
        logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
    rows = mx.repeat(mx.arange(len(prompts)), group)
    if group > 1:  # each prompt's rows share what it read
        for c in cache:
            c.filter(rows)
        logits = logits[rows]
    cap = -(-(width + 1) // BLOCK) * BLOCK  # room for the first decode step
    ks, vs = grow_caches(
        [c.keys[..., :width, :] for c in cache], [c.values[..., :width, :] for c in cache], cap
    )
    left, shift = mx.array(pad, dtype=mx.int32)[rows], mx.array(shift, dtype=mx.int32)[rows]
    return logits, ks, vs, left, shift, cap


def _decode(
    model,
    prompts,
    max_new_tokens,
    eos,
    s,
    group,
    keys,
    stop=None,
    on_token=None,
    on_logits=None,
    logps=None,
    images=None,
) -> list[list[int]]:
    """One batch of prompts: read left-padded into one cache, the cache and the last logits
    tiled ``group`` times, then one compiled step a token for every row (fixed-capacity caches
    grown ``BLOCK`` positions at a time), the device up to ``AHEAD`` steps ahead of the host that
    reads the tokens. Rows that finish stay in the batch until half of it has, then the batch is
    cut to the next power of two that holds the rows still going."""
    logits, ks, vs, left, shift, cap = prefill(model, prompts, group, images)
    pos = max(len(p) for p in prompts)  # positions written
    idx = mx.array([pos], dtype=mx.int32)
    slots = list(range(len(prompts) * group))  # each batch row's output row; -1: a filler
    new: list[list[int]] = [[] for _ in slots]
    if logps is not None:
        logps += [[] for _ in slots]
    done = [False] * len(slots)
    tokens, keys = draw(logits, keys, s)
    step = decode_step(model, FixedKVCache)

    def lp(z, t):  # the drawn tokens' log-probabilities, when asked for
        return token_logps(z, t) if logps is not None else None

    # steps the device runs ahead of the host: each entry, a step's tokens, the batch layout
    # they were drawn in and the logits they were drawn from
    queue = deque([(tokens, slots, logits if on_logits else None, lp(logits, tokens))])
    queued = 1
    while queue:
        while queued < max_new_tokens and len(queue) < AHEAD:
            if pos == cap:
                cap += BLOCK
                ks, vs = grow_caches(ks, vs, cap)
            # the caches go in with no other reference left, so the step writes into them in
            # place (a buffer still referenced would be copied whole, every layer, every step)
            caches, ks, vs = (ks, vs), None, None
            z, ks, vs, idx = step(tokens, *caches, idx, left, shift)
            del caches
            tokens, keys = draw(z, keys, s)
            got = lp(z, tokens)
            mx.async_eval(tokens, keys, ks, vs, idx, *([] if got is None else [got]))
            queue.append((tokens, slots, z if on_logits else None, got))
            queued += 1
            pos += 1
        drawn, layout, z, got = queue.popleft()
        if on_logits is not None:
            on_logits([r if r >= 0 and not done[r] else -1 for r in layout], z)
        lps = got.tolist() if got is not None else None
        for j, t in enumerate(drawn.tolist()):
            r = layout[j]
            if r >= 0 and not done[r]:
                if lps is not None:
                    logps[r].append(lps[j])
                done[r] = _ends(new[r], t, r, eos, stop, on_token)
        going = [j for j, r in enumerate(slots) if r >= 0 and not done[r]]
        if not going:
            break
        if len(going) <= len(slots) // 2:  # cut the batch to a power of two
            size = 1 << (len(going) - 1).bit_length()
            fill = [j for j, r in enumerate(slots) if r < 0 or done[r]][: size - len(going)]
            take = sorted(going + fill)
            sel = mx.array(take)
            tokens, keys, left, shift = tokens[sel], keys[sel], left[sel], shift[sel]
            ks, vs = [k[sel] for k in ks], [v[sel] for v in vs]
            kept = set(going)
            slots = [slots[j] if j in kept else -1 for j in take]
    return new


def decode_answer(tokenizer, ids: list[int]) -> str:
    """Generated ids (eos already left out by ``generate_ids``) as text, without special tokens:
    no chat-template markers or end-of-turn tokens in an answer."""
    return tokenizer.decode(ids, skip_special_tokens=True)
