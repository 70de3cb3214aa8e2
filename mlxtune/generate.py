"""Generation for samples, the exact-match metric and ``generate``: prompts of any lengths in one
left-padded batch (mlx-lm's batched KV cache), each prompt read once for all its completions,
greedy or sampled (temperature, top-k, top-p, min-p) with a key of each row's own."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from .adapters import apply_adapters
from .checkpoint import load_trained
from .errors import UserInputError
from .export import adapter_modules, adapter_settings, import_adapter
from .gguf_tokenizer import write_tokenizer_from_gguf
from .models import is_gguf, load_model, resolve_model_path
from .tokenizer import load_tokenizer


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


def _draw(logits: mx.array, keys: mx.array, s: Sampling) -> tuple[mx.array, mx.array]:
    """(tokens [B], the rows' next keys): argmax of the filtered logits plus Gumbel noise, each
    row from its own key, so a row draws what it would draw in any other batch."""
    if s.temperature <= 0:
        return mx.argmax(logits, axis=-1), keys
    pairs = mx.vmap(lambda k: mx.random.split(k))(keys)  # [B, 2, 2]
    noise = mx.vmap(lambda k: mx.random.gumbel(shape=logits.shape[-1:], key=k))(pairs[:, 1])
    return mx.argmax(filtered_logits(logits, s) + noise, axis=-1), pairs[:, 0]


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
) -> list[list[int]]:
    """New token ids (without the prompt, EOS left out) of ``group`` completions of each prompt,
    prompt-major. Prompts of any lengths decode together, left-padded in one batched KV cache;
    each prompt is read once and its cache copied to its ``group`` rows. Rows stop at EOS and
    leave the batch. ``sampling`` (default: ``temperature`` alone) draws each row from its own
    key (``keys`` [rows, 2], default ``row_keys(seed, ...)``). ``stop`` also ends a row at the
    token that completes one of its strings (that token kept). ``on_token(row, token)`` hears
    each new token as it is drawn (streaming)."""
    s = sampling or Sampling(temperature=temperature)
    keys = keys if keys is not None else row_keys(seed, len(prompts), group)
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    try:
        step = max(1, max_batch // group)
        for at in range(0, len(prompts), step):
            chunk = prompts[at : at + step]
            ks = keys[at * group : (at + len(chunk)) * group]
            hear = None
            if on_token is not None:
                hear = lambda r, t, at=at: on_token(at * group + r, t)  # noqa: E731
            out += _decode(model, chunk, max_new_tokens, eos, s, group, ks, stop, hear)
    finally:
        model.train(was_training)
    return out


def _batch_cache(model, pad: list[int]) -> list:
    """The model's per-layer caches as mlx-lm's batched, left-padded KV caches."""
    plain = (
        model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    )
    out = []
    for c in plain:
        if type(c) is not KVCache:
            raise UserInputError(
                f"batched generation needs plain KV caches; this model uses {type(c).__name__}",
                "model",
            )
        out.append(BatchKVCache(pad))
    return out


def _decode(
    model, prompts, max_new_tokens, eos, s, group, keys, stop=None, on_token=None
) -> list[list[int]]:
    """One batch of prompts: read left-padded into one cache, the cache and the last logits
    tiled ``group`` times, then one token a step for every row still going."""
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    cache = _batch_cache(model, pad)
    x = mx.array([[0] * k + p for k, p in zip(pad, prompts, strict=True)])
    if width > 1 and hasattr(model, "model"):
        # all but the last position through the backbone alone (their cache, none of their
        # [B, T, vocab] logits), then the last position for its logits
        model.model(x[:, :-1], cache=cache)
        x = x[:, -1:]
    logits = model(x, cache=cache)[:, -1, :]
    if group > 1:  # each prompt's rows share what it read
        rows = mx.repeat(mx.arange(len(prompts)), group)
        for c in cache:
            c.filter(rows)
        logits = logits[rows]
    alive = list(range(len(prompts) * group))  # the batch's rows, by output row
    new: list[list[int]] = [[] for _ in alive]
    tokens, keys = _draw(logits.astype(mx.float32), keys, s)
    for n in range(max_new_tokens):
        # the next step's forward is queued before this step's tokens are read: the device
        # computes it (for every row, finished ones too) while the host checks the rows
        ahead = None
        if n < max_new_tokens - 1:
            ahead = model(tokens[:, None], cache=cache)[:, -1, :]
            mx.async_eval(ahead, tokens, keys)
        keep = []
        for j, t in enumerate(tokens.tolist()):
            if t in eos:
                continue
            new[alive[j]].append(t)
            if on_token is not None:
                on_token(alive[j], t)
            if stop is not None and stop.ends(new[alive[j]]):
                continue
            keep.append(j)
        if not keep or ahead is None:
            break
        if len(keep) < len(alive):  # finished rows leave the batch
            idx = mx.array(keep)
            for c in cache:
                c.filter(idx)
            ahead, keys = ahead[idx], keys[idx]
            alive = [alive[j] for j in keep]
        tokens, keys = _draw(ahead.astype(mx.float32), keys, s)
    return new


def normalise_answer(s: str) -> str:
    return " ".join(s.split())


def decode_answer(tokenizer, ids: list[int]) -> str:
    """Generated ids (eos already left out by ``generate_ids``) as text, without special tokens:
    no chat-template markers or end-of-turn tokens in an answer."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def exact_match(model, tokenizer, examples, max_new_tokens: int) -> tuple[float, list[dict]]:
    """Share of examples whose greedy answer equals the reference (whitespace-normalised), and
    a row per example: ``prompt`` (as a person reads it: the last user message for chat data),
    ``prompt_text`` (the whole prompt the model read), ``answer``, ``reference``, ``correct``."""
    ids = [e.prompt_ids for e in examples]
    new = generate_ids(model, ids, max_new_tokens, eos_ids(tokenizer))
    answers = [decode_answer(tokenizer, n) for n in new]
    rows = []
    hits = 0
    for e, a in zip(examples, answers, strict=True):
        ok = normalise_answer(a) == normalise_answer(e.answer)
        hits += ok
        rows.append(
            {
                "prompt": e.shown_prompt,
                "prompt_text": e.prompt,
                "answer": a,
                "reference": e.answer,
                "correct": ok,
            }
        )
    return hits / max(len(examples), 1), rows


def sample(model: nn.Module, tokenizer, cfg, valid_set, step: int) -> list[dict]:
    """Samples for a run's samples section ``cfg``, from its own prompts (encoded as written)
    or the first ``cfg.count`` validation prompts as the model reads them in training; drawn
    with the step as seed. Each is ``{"prompt", "prompt_text", "completion"}``: ``prompt`` as
    a person reads it (a recipe prompt as written; for chat data the last user message),
    ``prompt_text`` the whole text the model read (chat template included)."""
    if cfg.prompts:
        shown = texts = list(cfg.prompts)
        ids = [list(tokenizer.encode(p)) for p in texts]
    else:
        chosen = [e for e in valid_set.examples if e.prompt_ids][: cfg.count]
        shown = [e.shown_prompt for e in chosen]
        texts, ids = [e.prompt for e in chosen], [e.prompt_ids for e in chosen]
    if not ids:
        return []
    eos = eos_ids(tokenizer)
    new = generate_ids(model, ids, cfg.max_new_tokens, eos, cfg.temperature, seed=step)
    return [
        {"prompt": p, "prompt_text": t, "completion": decode_answer(tokenizer, n)}
        for p, t, n in zip(shown, texts, new, strict=True)
    ]


def tokenizer_of(path: Path):
    """The tokenizer of a model folder, or of a GGUF file (read from its metadata)."""
    if not is_gguf(path):
        return load_tokenizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_from_gguf(path, tmp)
        return load_tokenizer(tmp)


def load_for_generation(
    model: str | Path, adapter: str | Path | None = None, scale: float | None = None, warn=None
):
    """(model, tokenizer) from a Hugging Face layout directory (a fused export too) or an mlxtune
    run/checkpoint, with an optional mlx-lm or PEFT adapter; ``scale`` multiplies the adapter's.
    ``warn(message)`` hears of damaged checkpoints passed over in a run."""
    p = Path(model)
    if (p / "trainer_state.json").exists() or (p / "checkpoints").is_dir():
        t = load_trained(p, warn)
        m, tok = t.model, t.tokenizer
    else:
        path = resolve_model_path(str(model), None)
        m, _ = load_model(path)
        tok = tokenizer_of(path)
    if adapter is not None:
        s = adapter_settings(adapter)
        if s["type"] not in ("lora", "dora"):
            raise UserInputError(
                f"a {s['type']!r} adapter holds whole weights; load it as --model", str(adapter)
            )
        apply_adapters(m, s["type"], s["rank"], s["alpha"], 0.0, s["targets"], s["layers"])
        import_adapter(m, adapter)
    if scale is not None:
        mods = adapter_modules(m)
        if not mods:
            raise UserInputError(
                "--scale needs an adapter (--adapter, or a LoRA/DoRA run)", "--scale"
            )
        for _, mod in mods:
            mod.scale = mod.scale * scale
    m.eval()
    return m, tok
