"""Generation for samples and the exact-match metric: greedy or sampled, batched by prompt
length (so no padding is needed), with mlx-lm's KV cache."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

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


def generate_ids(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: set[int],
    temperature: float = 0.0,
    seed: int = 0,
    max_batch: int = 64,
) -> list[list[int]]:
    """New token ids for each prompt (without the prompt, eos not included)."""
    was_training = model.training
    model.eval()
    key = mx.random.key(seed)
    out: list[list[int] | None] = [None] * len(prompts)
    by_len = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    try:
        for _, idx in sorted(by_len.items()):
            for s in range(0, len(idx), max_batch):
                group = idx[s : s + max_batch]
                cache = make_prompt_cache(model)
                x = mx.array([prompts[i] for i in group])
                done = [False] * len(group)
                new = [[] for _ in group]
                for _ in range(max_new_tokens):
                    logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
                    if temperature > 0:
                        key, sub = mx.random.split(key)
                        nxt = mx.random.categorical(logits / temperature, key=sub)
                    else:
                        nxt = mx.argmax(logits, axis=-1)
                    for j, t in enumerate(nxt.tolist()):
                        if done[j]:
                            continue
                        if t in eos:
                            done[j] = True
                        else:
                            new[j].append(t)
                    if all(done):
                        break
                    x = nxt[:, None]
                for j, i in enumerate(group):
                    out[i] = new[j]
    finally:
        model.train(was_training)
    return out


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
