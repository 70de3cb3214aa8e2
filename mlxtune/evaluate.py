"""Did training help? The exact-match metric and samples a run logs as it trains, and a run's
trained model beside the model it started from, on the run's own validation and test data
(``mlxtune eval RUN_DIR --base``): the objective's evaluation (loss, perplexity, ...), the exact
match where the data has answers, and a few answers of each. Nothing in the run directory is
written."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import mlx.nn as nn

from .config import recipe_from_dict
from .distributed import World
from .engine.optim import optimizer_for
from .engine.steps import Engine
from .errors import UserInputError
from .generate import decode_answer, eos_ids, generate_ids
from .kernels.selection import kernel_tiers
from .models import lm_parts
from .objectives import Components, build_objective, objective_class
from .runs.checkpoint import base_model, find_checkpoint, load_checkpoint

SHOWN = 3
"""Answers shown side by side."""


def normalise_answer(s: str) -> str:
    return " ".join(s.split())


def answerable(examples) -> Iterator:
    """The examples whose completion is a reference answer for exact match: a prompt, an
    answer, and not marked undesirable (a KTO row's completion that is a bad answer)."""
    return (
        e for e in examples if e.prompt_ids and e.answer is not None and getattr(e, "label", True)
    )


def exact_match(model, tokenizer, examples, max_new_tokens: int) -> tuple[float, list[dict]]:
    """Share of examples whose greedy answer equals the reference (whitespace-normalised), and
    a row per example: ``prompt`` (as a person reads it: the last user message for chat data),
    ``prompt_text`` (the whole prompt the model read), ``answer``, ``reference``, ``correct``."""
    ids = [e.prompt_ids for e in examples]
    new = generate_ids(
        model, ids, max_new_tokens, eos_ids(tokenizer), images=shown_images(examples)
    )
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
                **({"images": list(e.images)} if getattr(e, "images", None) else {}),
            }
        )
    return hits / max(len(examples), 1), rows


def sample(model: nn.Module, tokenizer, cfg, valid_set, step: int) -> list[dict]:
    """Samples for a run's samples section ``cfg``, from its own prompts (encoded as written)
    or the first ``cfg.count`` validation prompts as the model reads them in training; drawn
    with the step as seed. Each is ``{"prompt", "prompt_text", "completion"}``: ``prompt`` as
    a person reads it (a recipe prompt as written; for chat data the last user message),
    ``prompt_text`` the whole text the model read (chat template included)."""
    pictures = None
    if cfg.prompts:
        shown = texts = list(cfg.prompts)
        ids = [list(tokenizer.encode(p)) for p in texts]
    else:
        chosen = list(itertools.islice((e for e in valid_set.examples if e.prompt_ids), cfg.count))
        shown = [e.shown_prompt for e in chosen]
        texts, ids = [e.prompt for e in chosen], [e.prompt_ids for e in chosen]
        pictures = shown_images(chosen)
    if not ids:
        return []
    eos = eos_ids(tokenizer)
    new = generate_ids(
        model, ids, cfg.max_new_tokens, eos, cfg.temperature, seed=step, images=pictures
    )
    rows = [
        {"prompt": p, "prompt_text": t, "completion": decode_answer(tokenizer, n)}
        for p, t, n in zip(shown, texts, new, strict=True)
    ]
    for row, files in zip(rows, pictures or (), strict=False):
        if files:  # which picture the prompt showed (the dashboard names it)
            row["images"] = list(files)
    return rows


def shown_images(examples) -> list | None:
    """The examples' image files, a tuple each (a vision model's prompts), or None when none
    shows any."""
    files = [getattr(e, "images", None) or () for e in examples]
    return files if any(files) else None


def evaluate_run(run_dir: str | Path, base: bool = False, shown: int = SHOWN, warn=None) -> dict:
    """The run's trained model (the checkpoint ``export`` would pick) on its validation data,
    and with ``base`` the model it started from: ``{"checkpoint", "models": {"base"?,
    "trained"}, "answers": [...]}``. Each model gets the objective's evaluation metrics and,
    where the test split has prompts with answers (``eval.exact_match`` of them, else 100),
    ``exact_match``; ``answers`` holds the first ``shown`` prompts, their reference and each
    model's greedy answer."""
    run = Path(run_dir)
    resolved = run / "config_resolved.json"
    if not resolved.exists():
        raise UserInputError("not a run directory (no config_resolved.json)", str(run))
    cfg = json.loads(resolved.read_text())
    recipe = recipe_from_dict(cfg["recipe"], cfg.get("recipe_file") or "<recipe>")
    ckpt = find_checkpoint(run, warn)
    trained = load_checkpoint(ckpt)
    models = {"trained": trained.model}
    if base:
        state = json.loads((ckpt / "trainer_state.json").read_text())
        if not state.get("base_model_dir"):
            raise UserInputError(
                "this run trained a new model from scratch: it has no base to compare with",
                "--base",
            )
        models = {"base": base_model(state)[0], **models}
    tok = trained.tokenizer
    train, valid, test = objective_class(recipe).datasets(recipe, tok)
    pad = next(i for i in (tok._tokenizer.pad_token_id, tok.eos_token_id, 0) if i is not None)
    tiers = kernel_tiers(recipe, lambda _: None)
    examples = list(itertools.islice(answerable(test.examples), recipe.eval.exact_match or 100))
    out: dict = {"run": str(run), "checkpoint": ckpt.name, "models": {}, "answers": []}
    answers = {}
    for name, model in models.items():
        model.freeze()  # evaluated only: no optimizer state for any weight
        model.eval()
        parts = Components(tok, model, lm_parts(model), train, valid, test, pad, tiers, False)
        objective = build_objective(recipe, parts)
        engine = Engine(model, optimizer_for(recipe, 1), objective, recipe, World())
        metrics = dict(objective.evaluate(engine, World()))
        if examples:
            acc, rows = exact_match(model, tok, examples, recipe.eval.max_new_tokens)
            metrics["exact_match"] = acc
            metrics["exact_match_examples"] = len(examples)
            answers[name] = rows
        out["models"][name] = metrics
    for i in range(min(shown, len(examples))):
        row = {"prompt": examples[i].shown_prompt, "reference": examples[i].answer}
        row.update({name: answers[name][i]["answer"] for name in models})
        out["answers"].append(row)
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def format_comparison(result: dict) -> str:
    """``evaluate_run``'s result as text: a metric a line, a column a model, then the answers."""
    names = list(result["models"])
    keys = [k for k in next(iter(result["models"].values())) if k != "exact_match_examples"]
    lines = [f"{result['run']} ({result['checkpoint']})", ""]
    lines.append(f"{'':24}" + "".join(f"{n:>14}" for n in names))
    for k in keys:
        cells = []
        for n in names:
            v = result["models"][n].get(k)
            cells.append(f"{100 * v:13.1f}%" if k == "exact_match" else f"{_cell(v):>14}")
        lines.append(f"{k:24}" + "".join(cells))
    first = result["models"][names[-1]]
    if "exact_match" in first:
        lines.append(f"{'':24}(exact match over {first['exact_match_examples']} held-out prompts)")
    for row in result["answers"]:
        lines += ["", f"prompt     {row['prompt']}", f"reference  {row['reference']}"]
        lines += [f"{n:10} {row[n]}" for n in names]
    return "\n".join(lines)
