"""Export a trained model to the formats other tools load, and import adapters back.

- ``mlx-lm``: adapter_config.json + adapters.safetensors (mlx-lm's names: lora_a [in, r],
  lora_b [r, out], an absolute scale), loaded by ``mlx_lm.load(base, adapter_path=...)``.
- ``peft``: adapter_config.json (r, lora_alpha, target_modules, base_model_name_or_path) +
  adapter_model.safetensors (``base_model.model.<module>.lora_A.weight`` [r, in] and
  ``lora_B.weight`` [out, r]; DoRA magnitudes as ``lora_magnitude_vector``), as PEFT saves.
- ``fused``: the base with the adapters merged in, Hugging Face layout.

A reward model's score head goes with every format: ``fused`` writes Hugging Face's
``*ForSequenceClassification`` layout (``score.weight``, one label), ``peft`` a ``SEQ_CLS``
adapter with ``score`` among its ``modules_to_save``, and the others ``reward_head.safetensors``
(``score.weight`` [1, hidden]) beside their files.

A checkpoint is self-describing (trainer_state.json names the base model, its config, the
tokenizer and the adapter), so ``load_trained`` rebuilds the trained model from it alone.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .adapters import DoRALinear, LoRALinear, LoRASwitchLinear, lora_scale
from .errors import UserInputError
from .gguf.export import write_gguf_adapter, write_gguf_model
from .modelfile import modelfile
from .models import (
    DTYPES,
    PICKLED,
    cast_floats,
    hf_architecture,
    is_gguf,
    is_quantized,
    load_gguf,
    pickled_hint,
    quantize_model,
    reward_head,
    reward_head_aside,
    save_model,
    value_head,
    without_reward_head,
    without_value_head,
)
from .models.heads import VALUE_HEAD
from .models.layout import published_names

FORMATS = ("mlx-lm", "peft", "fused", "gguf", "gguf-adapter")
REWARD_HEAD_FILE = "reward_head.safetensors"
VALUE_HEAD_FILE = "value_head.safetensors"


@dataclass
class TrainedModel:
    """A model with its trained adapters (or weights) in place, and what it came from."""

    model: nn.Module
    tokenizer: object
    model_config: dict
    adapter: dict
    """type, rank, alpha, rslora, dropout, targets, layers (indices) and adapted (module names)."""
    base_dir: Path | None
    tokenizer_dir: Path | None


def load_trainable_weights(model: nn.Module, weights: dict, where: str):
    """Load weights that must each match a trainable parameter in name and shape."""
    params = dict(tree_flatten(model.trainable_parameters()))
    for k, v in weights.items():
        if k not in params:
            raise UserInputError(
                f"{k!r} is not a trainable parameter of this model and adapter", where
            )
        if v.shape != params[k].shape:
            raise UserInputError(
                f"{k}: shape {tuple(v.shape)} does not match the model's {tuple(params[k].shape)}",
                where,
            )
    missing = sorted(set(params) - set(weights))
    if missing:
        raise UserInputError(
            f"no weight for {missing[0]} (and {len(missing) - 1} more)"
            if len(missing) > 1
            else f"no weight for {missing[0]}",
            where,
        )
    model.load_weights(list(weights.items()), strict=False)


# ------------------------------------------------------------------------------ formats


def adapter_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def mlx_lm_config(t: TrainedModel) -> dict:
    a = t.adapter
    n_layers = len(t.model.layers)
    if a["type"] == "full":
        return {"fine_tune_type": "full", "num_layers": n_layers}
    keys = sorted({name.split(".", 2)[2] for name in a["adapted"]})
    return {
        "fine_tune_type": a["type"],
        "num_layers": n_layers - min(a["layers"]),
        "lora_parameters": {
            "rank": a["rank"],
            "scale": lora_scale(a["alpha"], a["rank"], a.get("rslora", False)),
            "dropout": a.get("dropout", 0.0),
            "keys": keys,
        },
        "base_model": str(t.base_dir) if t.base_dir else None,
    }


def write_reward_head(model: nn.Module, out: Path) -> None:
    """A reward model's score head as ``reward_head.safetensors`` in ``out`` (nothing for a
    language model)."""
    head = reward_head(model)
    if head is not None:
        mx.save_safetensors(str(out / REWARD_HEAD_FILE), {"score.weight": head.weight})


def read_trainable(folder: Path) -> dict[str, mx.array]:
    """The trainable weights a checkpoint (or mlx-lm adapter export) holds: its adapters, a
    reward model's head, and (a PPO checkpoint) the value head."""
    weights = mx.load(str(folder / "adapters.safetensors"))
    for extra in (REWARD_HEAD_FILE, VALUE_HEAD_FILE):
        if (folder / extra).exists():
            weights.update(mx.load(str(folder / extra)))
    return weights


def write_mlx_lm(t: TrainedModel, out: Path, metadata: dict | None = None):
    weights = without_reward_head(dict(tree_flatten(t.model.trainable_parameters())))
    weights = without_value_head(weights)
    write_reward_head(t.model, out)
    head = value_head(t.model)  # a checkpoint of a PPO run (exports set it aside first)
    if head is not None:
        mx.save_safetensors(
            str(out / VALUE_HEAD_FILE), dict(tree_flatten({VALUE_HEAD: head.parameters()}))
        )
    mx.save_safetensors(
        str(out / "adapters.safetensors"),
        weights,
        metadata={k: str(v) for k, v in (metadata or {}).items()},
    )
    (out / "adapter_config.json").write_text(json.dumps(mlx_lm_config(t), indent=2))
    if t.base_dir is not None and is_gguf(t.base_dir):
        write_gguf_base(t, out / "base")


def write_gguf_base(t: TrainedModel, out: Path):
    """A GGUF base as mlx-lm loads a base model (mlx-lm reads no GGUF): the weights the run
    trained over, in the family's Hugging Face layout with mlx-lm's quantization config when
    they stayed quantized (the file's codes, as held), and the tokenizer read from the file."""
    held = {str(v.dtype).split(".")[-1] for _, v in tree_flatten(t.model.parameters())}
    dtype = next((d for d in ("float32", "bfloat16", "float16") if d in held), "float32")
    keep = any(is_quantized(m) for _, m in t.model.named_modules())
    base, config, _ = load_gguf(t.base_dir, dtype, keep_quantized=keep)
    layers = {p: (m.group_size, m.bits) for p, m in base.named_modules() if is_quantized(m)}
    if layers:
        (group, bits), _ = Counter(layers.values()).most_common(1)[0]
        quant = {"group_size": group, "bits": bits, "mode": "affine"}
        for p, (g, b) in layers.items():
            if (g, b) != (group, bits):
                quant[p] = {"group_size": g, "bits": b, "mode": "affine"}
        config = {**config, "quantization": quant}
    save_model(base, config, out, t.tokenizer, t.tokenizer_dir)


def _plain_weights(model: nn.Module) -> dict[str, mx.array]:
    """The model's weights as its base holds them: each adapter's base weight at its path."""
    wrapped = {name for name, _ in adapter_modules(model)}
    out = {}
    for k, v in tree_flatten(model.parameters()):
        module, _, leaf = k.rpartition(".")
        if module in wrapped:
            continue  # lora_a, lora_b, a DoRA magnitude
        parent, _, inner = module.rpartition(".")
        out[f"{parent}.{leaf}" if inner == "linear" and parent in wrapped else k] = v
    return out


def peft_weights(model: nn.Module) -> dict[str, mx.array]:
    """PEFT's tensors, under the module names of the published layout (what transformers
    builds): the same as mlx-lm's wherever a family keeps them."""
    names = published_names(model, _plain_weights(model))
    out = {}
    for name, m in adapter_modules(model):
        key = f"base_model.model.{names.get(f'{name}.weight', f'{name}.weight')[: -len('.weight')]}"
        out[f"{key}.lora_A.weight"] = mx.contiguous(m.lora_a.T)
        out[f"{key}.lora_B.weight"] = mx.contiguous(m.lora_b.T)
        if isinstance(m, DoRALinear):
            out[f"{key}.lora_magnitude_vector"] = m.m
    return out


def peft_refusal(model: nn.Module) -> str | None:
    """Why the model's adapters have no PEFT form (None when they have one)."""
    experts = [n for n, m in adapter_modules(model) if isinstance(m, LoRASwitchLinear)]
    if experts:
        return (
            f"{experts[0]} is a mixture's experts, which mlx-lm stacks in one layer and PEFT "
            "names one by one (or not at all): export mlx-lm (the adapter) or fused instead, "
            "or leave the experts out of adapter.targets"
        )
    return None


def write_peft(t: TrainedModel, out: Path, base_name: str | None = None):
    a = t.adapter
    if a["type"] == "full":
        raise UserInputError(
            "PEFT adapters hold LoRA/DoRA weights; a full fine-tune exports as fused", "export"
        )
    why = peft_refusal(t.model)
    if why is not None:
        raise UserInputError(why, "export")
    weights = peft_weights(t.model)
    head = reward_head(t.model)
    if head is not None:  # PEFT keeps a sequence classifier's head whole (modules_to_save)
        weights["base_model.model.score.weight"] = head.weight
    mx.save_safetensors(str(out / "adapter_model.safetensors"), weights, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if head is None else "SEQ_CLS",
        "base_model_name_or_path": base_name or (str(t.base_dir) if t.base_dir else None),
        "r": a["rank"],
        "lora_alpha": a["alpha"],
        "use_rslora": a.get("rslora", False),
        "lora_dropout": a.get("dropout", 0.0),
        "target_modules": sorted(
            {k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in weights if ".lora_A." in k}
        ),
        "layers_to_transform": sorted(a["layers"]),
        "use_dora": a["type"] == "dora",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    if head is not None:
        config["modules_to_save"] = ["score"]
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def fuse(model: nn.Module) -> nn.Module:
    """Merge every LoRA/DoRA layer into a plain Linear, in place; returns the model."""
    fused = [(n, m.fused()) for n, m in adapter_modules(model)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    return model


def dequantize(model: nn.Module, config: dict) -> tuple[nn.Module, dict]:
    """Every quantized layer back to a dense one, and the config without quantization."""
    from mlx_lm.utils import dequantize_model

    if not any(is_quantized(m) for _, m in model.named_modules()):
        return model, config
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return dequantize_model(model), config


def write_fused(
    t: TrainedModel,
    out: Path,
    dtype: str | None = None,
    quantize: int | None = None,
    group_size: int = 64,
):
    """The model with its adapters merged in; de-quantized when the base was quantized, and
    quantized again (``quantize`` bits, affine, per group of ``group_size``) when asked.
    Returns a note when the weights could not be written in the published layout."""
    model, config = dequantize(fuse(t.model), t.model_config)
    if dtype is not None:
        cast_floats(model, dtype)
    if quantize is not None:
        try:  # the same quantization as QLoRA's (layers whose size does not fit stay dense)
            with reward_head_aside(model):  # a reward model's score head stays dense
                quantize_model(model, quantize, group_size)
        except UserInputError as e:
            raise UserInputError(e.message, "--quantize") from None
        config = {**config, "quantization": {"group_size": group_size, "bits": quantize}}
        dtype = None
    if reward_head(model) is not None:  # Hugging Face's sequence classifier, one label
        arch = hf_architecture(config.get("model_type", "")) or "ForCausalLM"
        config = {
            **config,
            "architectures": [arch.replace("ForCausalLM", "ForSequenceClassification")],
            "id2label": {"0": "LABEL_0"},
            "label2id": {"LABEL_0": 0},
            # the classifier reads the last token that is not padding: the score is the EOS's,
            # so EOS must not count as padding
            "pad_token_id": (
                None
                if config.get("pad_token_id") == config.get("eos_token_id")
                else config.get("pad_token_id")
            ),
        }
    _, published = save_model(model, config, out, t.tokenizer, t.tokenizer_dir, dtype)
    if published or quantize is not None:  # MLX's quantized layout is mlx-lm's alone anyway
        return None
    return (
        f"{config.get('model_type')}: the fused weights keep mlx-lm's layout (stacked experts, "
        "MLX conv weights), which mlx-lm loads; no rewrite into the published layout reads "
        "back through this family's sanitize, so transformers may not read them"
    )


def export(
    t: TrainedModel,
    fmt: str,
    out: Path,
    dtype: str | None = None,
    quantize: int | None = None,
    group_size: int = 64,
):
    """Write format ``fmt`` into the (existing, empty) folder ``out``; returns a note for the
    user, or None."""
    if quantize is not None and fmt != "fused":
        raise UserInputError(
            "--quantize applies to fused exports (gguf has --dtype q8_0)", "export"
        )
    if fmt == "mlx-lm":
        if t.adapter["type"] == "full":
            raise UserInputError(
                "mlx-lm adapters hold LoRA/DoRA weights; a full fine-tune exports as fused",
                "export",
            )
        write_mlx_lm(t, out)
    elif fmt == "peft":
        write_peft(t, out)
    elif fmt == "fused":
        if dtype is not None and dtype not in DTYPES:
            raise UserInputError(f"--dtype for fused must be one of {', '.join(DTYPES)}", "export")
        return write_fused(t, out, dtype, quantize, group_size)
    elif fmt == "gguf":
        # a GGUF base names the file after itself, without its .gguf
        name = (
            (Path(t.base_dir).stem if Path(t.base_dir).is_file() else Path(t.base_dir).name)
            if t.base_dir
            else "model"
        )
        model, config = dequantize(fuse(t.model), t.model_config)
        source = Path(t.base_dir) if t.base_dir and is_gguf(t.base_dir) else None
        with reward_head_aside(model):  # GGUF holds the language model; the head goes beside
            path = write_gguf_model(
                model, config, t.tokenizer, t.tokenizer_dir, out, dtype or "f16", name, source
            )
        write_reward_head(t.model, out)
        text = modelfile(t.tokenizer, f"./{path.name}", base_dir=t.base_dir)
        (out / "Modelfile").write_text(text)
    elif fmt == "gguf-adapter":
        if t.adapter["type"] != "lora":
            raise UserInputError(
                "gguf-adapter holds LoRA weights; export a full or DoRA run as gguf", "export"
            )
        # the file's alpha is read as alpha / rank: rsLoRA's scale goes in as scale x rank
        a = t.adapter
        alpha = lora_scale(a["alpha"], a["rank"], a.get("rslora", False)) * a["rank"]
        path = write_gguf_adapter(t.model, t.model_config, alpha, out)
        write_reward_head(t.model, out)
        if t.base_dir:  # Ollama runs the adapter over the base it was trained on
            base = str(Path(t.base_dir).resolve())
            text = modelfile(t.tokenizer, base, f"./{path.name}", base_dir=t.base_dir)
            (out / "Modelfile").write_text(text)
    else:
        raise UserInputError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}", "export")


# ------------------------------------------------------------------------------ import


def read_adapter(path: str | Path) -> dict[str, mx.array]:
    """An mlx-lm or PEFT adapter directory, as weights under mlxtune's (mlx-lm's) names."""
    p = Path(path)
    if p.is_file():
        why = "pickled weights are never loaded; " if p.suffix in PICKLED else ""
        raise UserInputError(
            f"{why}an adapter is a directory with adapter_config.json and adapters.safetensors "
            "(mlx-lm) or adapter_model.safetensors (PEFT)",
            str(p),
        )
    cfg_path = p / "adapter_config.json"
    if not cfg_path.exists():
        raise UserInputError(
            "no adapter_config.json: not an mlx-lm or PEFT adapter directory", str(p)
        )
    if (p / "adapters.safetensors").exists():
        return _load_weights(p / "adapters.safetensors")
    if (p / "adapter_model.safetensors").exists():
        weights = {}
        for k, v in _load_weights(p / "adapter_model.safetensors").items():
            name = k.removeprefix("base_model.model.")
            if name.endswith(".lora_A.weight"):
                weights[name.removesuffix(".lora_A.weight") + ".lora_a"] = mx.contiguous(v.T)
            elif name.endswith(".lora_B.weight"):
                weights[name.removesuffix(".lora_B.weight") + ".lora_b"] = mx.contiguous(v.T)
            elif name.endswith(".lora_magnitude_vector") or name.endswith(
                ".lora_magnitude_vector.weight"
            ):
                weights[name.split(".lora_magnitude_vector")[0] + ".m"] = v
            else:
                raise UserInputError(
                    f"unexpected tensor {k!r} in a PEFT adapter",
                    str(p / "adapter_model.safetensors"),
                )
        return weights
    raise UserInputError(
        f"no adapters.safetensors or adapter_model.safetensors{pickled_hint(p)}", str(p)
    )


def _load_weights(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except RuntimeError as e:  # MLX's reader: a truncated or corrupt file
        raise UserInputError(f"cannot read the weights: {e}", str(path)) from None


def import_adapter(model: nn.Module, path: str | Path):
    """Load an mlx-lm or PEFT adapter into a model whose adapters are already in place."""
    load_trainable_weights(model, read_adapter(path), str(path))


def adapter_settings(path: str | Path) -> dict:
    """LoRA settings (type, rank, alpha, targets, layers) from an mlx-lm or PEFT adapter_config.json."""
    p = Path(path)
    try:
        cfg = json.loads((p / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise UserInputError(
            "no adapter_config.json: not an mlx-lm or PEFT adapter directory", str(p)
        ) from None
    except json.JSONDecodeError as e:
        raise UserInputError(f"adapter_config.json is not valid JSON: {e}", str(p)) from None
    if not isinstance(cfg, dict):
        raise UserInputError("adapter_config.json is not a JSON object", str(p))
    try:
        return _settings(cfg, p)
    except (KeyError, TypeError, AttributeError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else f"a field has the wrong type ({e})"
        raise UserInputError(f"adapter_config.json: {why}", str(p)) from None


def _settings(cfg: dict, p: Path) -> dict:
    if "lora_parameters" in cfg:  # mlx-lm
        lp = cfg["lora_parameters"]
        keys = lp.get("keys")
        return {
            "type": cfg.get("fine_tune_type", "lora"),
            "rank": lp["rank"],
            "alpha": lp["scale"] * lp["rank"],  # the scale is absolute: alpha / rank
            "rslora": False,
            "targets": sorted({k.rsplit(".", 1)[-1] for k in keys}) if keys else ["all-linear"],
            "layers": cfg.get("num_layers"),
        }
    if cfg.get("peft_type") == "LORA":
        targets = cfg.get("target_modules")
        if not isinstance(targets, list):
            raise UserInputError(
                "target_modules as a regular expression is not supported; list the module names",
                str(p),
            )
        return {
            "type": "dora" if cfg.get("use_dora") else "lora",
            "rank": cfg["r"],
            "alpha": cfg["lora_alpha"],
            "rslora": bool(cfg.get("use_rslora", False)),
            "targets": targets,
            "layers": cfg.get("layers_to_transform"),
        }
    raise UserInputError(
        "adapter_config.json is neither mlx-lm's (lora_parameters) nor PEFT's (peft_type LORA)",
        str(p),
    )
