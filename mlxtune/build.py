"""From a recipe to the components of a run: kernel tiers, tokenizer, model (quantized,
adapted, checkpointed), datasets, and the schedule and optimizer. Each function logs what it
did through the ``log`` it is handed and refuses bad input with a ``UserInputError`` naming the
recipe key; none of them knows about the loop."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import qat
from .adapters import VISION_TARGETS, adapt_model, lora_scale
from .config import Recipe
from .data import BadRows, lengths_of, read_rows
from .data.parallel import reporting
from .errors import UserInputError
from .export import TrainedModel, adapter_settings, import_adapter
from .memory import GB
from .models import (
    LMParts,
    VisionLM,
    add_embedding_noise,
    build_model,
    cast_floats,
    checkpoint_layers,
    count_parameters,
    dequantize_for_training,
    is_gguf,
    is_vision_config,
    lm_parts,
    load_gguf,
    load_image_tokens,
    load_model,
    load_vision_model,
    module_at,
    quantize_model,
    resolve_model_path,
    write_vision_base,
)
from .objectives import Components, Objective, objective_class
from .runs.rundir import RunDir
from .tokenizer import load_tokenizer, model_tokenizer, tokenizer_texts, train_sentencepiece


@dataclass
class Built:
    """A recipe's components, with what they came from."""

    components: Components
    model_config: dict
    model_dir: Path | None
    """The base model's folder (None for a model built from ``model.arch``)."""
    tokenizer_dir: Path | None
    adapter_info: dict
    """What ``adapt_model`` did: the adapted modules and layers."""
    trainable: int
    total_params: int
    kind: type[Objective]
    """The recipe's objective class: what read the data and extended the model."""
    max_length: int
    """data.max_length as resolved: the recipe's number, or for ``auto`` the longest example
    read up to ``auto_context``."""
    auto_context: int | None = None
    """data.max_length: auto: the context the data was read up to (the model's)."""

    def trained(self, recipe: Recipe) -> TrainedModel:
        """The model being trained, with what it came from, for checkpoints and exports."""
        a, c = recipe.adapter, self.components
        learned = getattr(recipe.objective, "student_quantization", None)
        adapter = {
            "type": qat.LEARNED if learned is not None else a.type,
            "rank": a.rank,
            "alpha": a.alpha,
            "rslora": a.rslora,
            "dropout": a.dropout,
            "targets": list(a.targets),
            "layers": self.adapter_info.get("layers"),
            "adapted": self.adapter_info["adapted"],
        }
        q = recipe.train.qat or learned  # the format its quantized exports keep
        return TrainedModel(
            c.model, c.tokenizer, self.model_config, adapter, self.model_dir, self.tokenizer_dir,
            qat.Spec(q.bits, q.group_size, getattr(q, "mode", "affine")).as_dict() if q else None,
        )  # fmt: skip


def tokenizer_for(
    recipe: Recipe,
    run_dir: RunDir,
    model_dir: Path | None,
    train_rows: list[tuple[int, dict]],
    resuming: bool,
    log,
) -> tuple[Any, Path | None]:
    """(tokenizer, its folder): loaded from ``tokenizer.path`` or the model's folder, or trained
    on the training data's rows (a resumed run reads back the one it trained)."""
    r = recipe
    if r.tokenizer.train is not None and resuming:
        folder = run_dir.inside("tokenizer")
        tokenizer = load_tokenizer(folder)
    elif r.tokenizer.train is not None:
        t, train_path = r.tokenizer.train, r.resolve_path(r.data.train)
        folder = run_dir.inside("tokenizer")
        log(
            f"training a {t.model_type} sentencepiece tokenizer (vocab {t.vocab_size}) on {train_path}"
        )
        tokenizer = train_sentencepiece(
            tokenizer_texts(train_rows),
            folder,
            t.vocab_size,
            t.model_type,
            t.character_coverage,
            t.max_sentences,
            r.train.seed,
        )
    elif r.tokenizer.path is None and model_dir is not None and is_gguf(model_dir):
        # a GGUF model's tokenizer is in its metadata: written out once as a folder in the run
        folder = run_dir.inside("tokenizer")
        tokenizer = model_tokenizer(model_dir, keep_in=folder, log=log)
    else:
        folder = r.resolve_path(r.tokenizer.path) if r.tokenizer.path else model_dir
        if folder is None:
            raise UserInputError("no tokenizer: set tokenizer.path or tokenizer.train", "tokenizer")
        tokenizer = load_tokenizer(folder, trust_remote_code=r.model.trust_remote_code)
    if r.tokenizer.chat_template is not None:
        tokenizer._tokenizer.chat_template = r.tokenizer.chat_template
    config = vision_config(model_dir)
    if config is not None:  # a vision model's images are tokens too: its processor says how many
        tokenizer.image_tokens = load_image_tokens(model_dir, config)
    return tokenizer, folder


VISION_OBJECTIVES = ("sft", "dpo", "orpo", "cpo")
"""The objectives that train vision-language models (their examples and pairs show images)."""


def refuse_what_vision_models_do_not_do(recipe: Recipe) -> None:
    """The settings a vision-language model does not train with (yet), each refused at its
    key: objectives other than SFT and the paired preference ones, and a token stream cut into
    rows (an example's images cannot be cut)."""
    r = recipe
    if r.objective.type not in VISION_OBJECTIVES:
        raise UserInputError(
            f"{r.objective.type} does not train vision-language models yet; use one of "
            f"{', '.join(VISION_OBJECTIVES)}",
            "objective.type",
        )
    if r.data.packing == "stream":
        raise UserInputError(
            "a stream cuts examples across rows, and an example's image tokens cannot be cut "
            "from their image; use packing: pack (whole examples) or off",
            "data.packing",
        )
    tower = [t for t in r.adapter.targets if t in VISION_TARGETS]
    if (
        tower
        and r.objective.type == "dpo"
        and getattr(r.objective, "reference", None) != ("precomputed")
    ):
        raise UserInputError(
            f"with adapters in the {tower[0]}, DPO's reference would read the images through "
            "the trained tower (the step's image features are the policy's): set "
            "objective.reference: precomputed (the reference's log-probs read once, before "
            "training), or leave the tower out",
            "adapter.targets",
        )


def vision_base(recipe: Recipe, run_dir: RunDir, tokenizer, tokenizer_dir, resuming: bool, log):
    """A vision-language model built from ``model.arch``: written into the run directory as
    its base model (``base/``, as mlx-vlm loads a folder) and trained from there like a
    downloaded one; a resumed run reads it back."""
    r = recipe
    if tokenizer_dir is None or r.tokenizer.train is not None:
        raise UserInputError(
            "a vision model built from model.arch needs a tokenizer folder with its image tokens "
            "and image processor (tokenizer.path)",
            "tokenizer.path",
        )
    out = run_dir.inside("base")
    if resuming and (out / "model.safetensors").exists():
        return out
    write_vision_base(r.model.arch, tokenizer, Path(tokenizer_dir), out, r.model.seed)
    log(f"built a new {r.model.arch['model_type']} model from model.arch into {out}")
    return out


def vision_config(model_dir: Path | None) -> dict | None:
    """The config.json of a vision-language model folder; None for anything else."""
    if model_dir is None or not model_dir.is_dir():
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):  # the model's loading says what is wrong with it
        return None
    return config if isinstance(config, dict) and is_vision_config(config) else None


def model_for(
    recipe: Recipe, tokenizer, tokenizer_dir: Path | None, model_dir: Path | None, log
) -> tuple[nn.Module, dict]:
    """(model, its config): built new from ``model.arch`` or loaded, quantized for QLoRA when
    the recipe asks; its vocabulary must hold the tokenizer's."""
    r = recipe
    vocab = len(tokenizer._tokenizer)
    if r.model.arch is not None and not is_vision_config(r.model.arch):
        special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
        model, config = build_model(r.model.arch, vocab, r.model.dtype, r.model.seed, special)
        log(f"built a new {config['model_type']} model from model.arch")
    elif is_gguf(model_dir):
        keep = r.adapter.type in ("lora", "dora") and not r.model.dequantize
        model, config, done = load_gguf(model_dir, r.model.dtype, keep_quantized=keep)
        log(f"loaded {model_dir} (GGUF, {config['model_type']}): {done.summary(r.model.dtype)}")
    elif (config := vision_config(model_dir)) is not None:
        model = load_vision_model(model_dir, config, r.model.dtype, r.model.trust_remote_code)
        log(
            f"loaded {model_dir} ({config['model_type']}, vision-language: its vision tower "
            "frozen, run outside the compiled step)"
        )
    else:
        # QLoRA quantizes the base as it is read, one layer at a time: never held dense whole
        lazy = r.model.quantize is not None
        model, config = load_model(model_dir, r.model.dtype, r.model.trust_remote_code, lazy=lazy)
        log(f"loaded {model_dir}")
        if r.adapter.type == "full":  # a quantized checkpoint trains in full de-quantized
            n, left = dequantize_for_training(model)
            if left:
                raise UserInputError(
                    f"full fine-tuning trains every weight, and {left[0]} holds quantized "
                    f"codes ({type(module_at(model, left[0])).__name__}) that mlxtune cannot "
                    "de-quantize; use adapter.type lora or dora",
                    "adapter.type",
                )
            if n:
                cast_floats(model, r.model.dtype)
                log(f"de-quantized {n} quantized layers to {r.model.dtype} for full fine-tuning")
    if r.model.arch is None and r.model.quantize is not None:
        _quantize_base(model, r.model.quantize, log)
    learned = getattr(r.objective, "student_quantization", None)
    if learned is not None:  # learned quantization: the student is the model, quantized
        _quantize_base(model, learned, log, "objective.student_quantization")
    model_vocab = config.get("vocab_size") or vocab
    if vocab > model_vocab:
        raise UserInputError(
            f"the tokenizer ({tokenizer_dir}) has {vocab} tokens but the model's vocabulary "
            f"({model_dir or 'model.arch'}) is {model_vocab}",
            "tokenizer",
        )
    return model, config


def _quantize_base(model: nn.Module, cfg, log, key: str = "model.quantize") -> None:
    """QLoRA: quantize the loaded base before the adapters go in (or, for learned
    quantization, the student whose scales train)."""
    q = quantize_model(model, cfg.bits, cfg.group_size)
    if not q["layers"] and not q["already"]:
        raise UserInputError(
            f"no layer's input size is a multiple of {q['group_size']}; use a smaller group_size",
            f"{key}.group_size",
        )
    log(
        f"quantized the base to {q['bits']} bits in groups of {q['group_size']}: "
        f"{q['layers']} layers, weights {q['bytes_before'] / GB:.3f} -> "
        f"{q['bytes_after'] / GB:.3f} GB"
        + (f"; {len(q['skipped'])} stay dense (input size)" if q["skipped"] else "")
    )


def adapt(recipe: Recipe, model: nn.Module, lm: LMParts, log) -> dict:
    """Put LoRA/DoRA adapters in (or unfreeze everything for full fine-tuning), load
    ``init_from`` weights, turn on NEFTune and gradient checkpointing; what ``adapt_model``
    did."""
    r, a = recipe, recipe.adapter
    mx.random.seed(r.train.seed)
    if getattr(r.objective, "student_quantization", None) is not None:
        info = qat.learn_scales(model)
        log(
            f"learned quantization: the scales and biases of {len(info['adapted'])} quantized "
            "layers train; their codes and every other weight are frozen"
        )
    else:
        info = adapt_model(model, a.type, a.rank, a.alpha, a.dropout, a.targets, a.layers, a.rslora)
    if a.init_from is not None:
        import_adapter(model, r.resolve_path(a.init_from))
        log(f"adapter weights from {a.init_from}")
        s = adapter_settings(r.resolve_path(a.init_from))
        was = lora_scale(s["alpha"], s["rank"], s["rslora"])
        now = lora_scale(a.alpha, a.rank, a.rslora)
        if not math.isclose(was, now, rel_tol=1e-6):
            log(
                f"adapter.init_from was trained at scale {was:g}; this run scales it by {now:g} "
                "(adapter.alpha / rank, or / sqrt(rank) with adapter.rslora)"
            )
    alpha = r.train.neftune_noise_alpha
    if alpha and r.objective.type == "sft":
        add_embedding_noise(model, alpha, lm.embed_path)
        log(f"NEFTune: token embeddings get uniform noise of alpha {alpha:g} while training")
    if r.train.qat is not None:
        qat.prepare(model, r.train.qat, log)
    if r.train.grad_checkpointing and r.train.grad_checkpointing != "auto":  # auto: later
        n = checkpoint_layers(model, int(r.train.grad_checkpointing))
        log(
            f"gradient checkpointing: {n} of {len(model.layers)} layers recompute "
            "their activations in the backward pass"
        )
    return info


def bad_rows(recipe: Recipe) -> BadRows:
    """What a data file's bad rows do (data.bad_rows, data.max_bad_fraction): one per file."""
    d = recipe.data
    return BadRows(d.bad_rows == "skip", d.max_bad_fraction)


def build(
    recipe: Recipe, run_dir: RunDir, tiers: dict[str, str], resuming: bool, log, progress=None
) -> Built:
    """Everything a recipe names, in the order each needs the one before. ``progress(label,
    done, total)`` hears how encoding the data goes (a console's progress bar)."""
    r = recipe
    d = r.data
    # The data's errors come before the model loads: a tokenizer trained on the data reads its
    # rows first; any other tokenizer loads first, and the data is encoded (or read from the
    # cache, which then reads no row) before the model, unless max_length: auto waits for the
    # model's context.
    kind = objective_class(r)  # its datasets and what it adds to the model
    training = r.tokenizer.train is not None and not resuming
    train_rows = read_rows(r.resolve_path(d.train), d.columns, bad_rows(r)) if training else []
    base = Path(r.source).parent if r.source else None
    model_dir = resolve_model_path(r.model.path, base) if r.model.path else None
    tokenizer, tokenizer_dir = tokenizer_for(r, run_dir, model_dir, train_rows, resuming, log)
    if r.model.arch is not None and is_vision_config(r.model.arch):
        model_dir = vision_base(r, run_dir, tokenizer, tokenizer_dir, resuming, log)
        tokenizer.image_tokens = load_image_tokens(model_dir, vision_config(model_dir))
    sets = None
    if d.max_length != "auto":
        with reporting(progress):
            sets = kind.datasets(r, tokenizer)
    model, config = model_for(r, tokenizer, tokenizer_dir, model_dir, log)
    if isinstance(model, VisionLM):
        refuse_what_vision_models_do_not_do(r)
    lm = lm_parts(model)
    info = adapt(r, model, lm, log)
    kind.extend(r, model, log)
    trainable, total = count_parameters(model)
    names = {k for k, _ in tree_flatten(model.trainable_parameters())}
    context, max_length = None, d.max_length
    if d.max_length == "auto":  # read up to the model's context, then the longest
        if r.objective.type != "sft":
            raise UserInputError(
                f"auto sizes SFT examples; give {r.objective.type}'s data a number",
                "data.max_length",
            )
        context = int(config.get("max_position_embeddings") or 1 << 20)
        with reporting(progress):
            sets = kind.datasets(replace(r, data=replace(d, max_length=context)), tokenizer)
    train, valid, test = sets
    if context is not None:
        max_length = max(max(lengths_of(ds.examples)) for ds in (train, valid, test))
    for ds in {id(ds): ds for ds in (train, valid, test)}.values():
        for line in ds.stats.skipped_rows:  # data.bad_rows: skip
            log(f"{ds.path}: {line}" if not line.startswith(" ") else line)
    pad_id = next(
        i for i in (tokenizer._tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None
    )
    components = Components(
        tokenizer=tokenizer,
        model=model,
        lm=lm,
        train_set=train,
        valid_set=valid,
        test_set=test,
        pad_id=pad_id,
        tiers=tiers,
        head_trains=bool(lm.head_names & names),
    )
    return Built(
        components,
        config,
        model_dir,
        tokenizer_dir,
        info,
        trainable,
        total,
        kind,
        max_length,
        context,
    )
