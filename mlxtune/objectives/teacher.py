"""A teacher beside the model that trains (distillation): any model mlxtune loads, frozen and in
eval mode, optionally quantized as it loads, refused by name when its vocabulary is not the
student's."""

from __future__ import annotations

from pathlib import Path

from mlx.utils import tree_flatten

from ..errors import UserInputError
from ..models import is_gguf, lm_parts, load_model, quantize_model, resolve_model_path
from ..tokenizer import model_tokenizer


def load_teacher(recipe, tokenizer, student_vocab: int, log):
    """(teacher model, its LMParts): loaded as the objective section says, frozen, in eval
    mode; refused by name where its vocabulary is not the student's."""
    cfg = recipe.objective
    base = Path(recipe.source).parent if recipe.source else None
    path = resolve_model_path(cfg.teacher, base)
    try:
        model, config = load_model(path, cfg.teacher_dtype, keep_quantized=True)
    except (OSError, ValueError) as e:
        raise UserInputError(f"cannot load the teacher {path}: {e}", "objective.teacher") from e
    _same_vocabulary(path, config, tokenizer, student_vocab)
    if cfg.teacher_bits is not None:
        q = quantize_model(model, cfg.teacher_bits, 64)
        if not q["layers"] and not q["already"]:
            raise UserInputError(
                "no layer of the teacher has an input size that is a multiple of 64 (the "
                "quantization group): it cannot be quantized; set teacher_bits: null",
                "objective.teacher_bits",
            )
    model.freeze()
    model.eval()
    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    log(
        f"teacher: {path} ({config.get('model_type')}, {size / 1e9:.3f} GB"
        + (f", quantized to {cfg.teacher_bits} bits" if cfg.teacher_bits else "")
        + ")"
    )
    return model, lm_parts(model)


def _same_vocabulary(path: Path, config: dict, tokenizer, student_vocab: int) -> None:
    """The teacher's logits must index the student's tokens: the same vocabulary size and, where
    the teacher has a tokenizer (its folder's, a GGUF file's metadata), the same ids."""
    where = "objective.teacher"
    size = int(config.get("vocab_size") or 0)
    if size != student_vocab:
        raise UserInputError(
            f"the teacher's vocabulary has {size} entries and the student's {student_vocab}: "
            "distillation compares their distributions token by token, so both need one "
            "vocabulary",
            where,
        )
    if not is_gguf(path) and not any(
        (Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model")
    ):
        return
    theirs = model_tokenizer(path)._tokenizer.get_vocab()
    ours = tokenizer._tokenizer.get_vocab()
    if theirs != ours:
        odd = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda x: (x[1], x[0]))[0]
        side = "the teacher's" if odd in theirs.items() else "the student's"
        raise UserInputError(
            f"the teacher's tokenizer is not the student's: {odd[0]!r} is id {odd[1]} in "
            f"{side} only ({len(theirs)} against {len(ours)} tokens); distillation needs one "
            "vocabulary",
            where,
        )


__all__ = ["load_teacher"]
