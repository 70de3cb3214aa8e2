"""What the model modules share: the families mlxtune trains, their Hugging Face class names,
and the float dtypes a model is held in."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import UserInputError

# The Hugging Face class names of the families GGUF files are read for (a GGUF file names no
# class); ``hf_architecture`` asks transformers for the rest.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    # families whose checkpoints run on their own code (no transformers class): the class
    # their published configs name, which tools of the field (llama.cpp's converter) key on
    "bailing_moe": "BailingMoeForCausalLM",
    "bailing_moe_v3": "BailingMoeV3ForCausalLM",
    "deepseek": "DeepseekForCausalLM",
    "hunyuan": "HunYuanMoEV1ForCausalLM",
    "internlm2": "InternLM2ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    # mlx-lm's minimax is MiniMax-M2 (transformers' MiniMaxForCausalLM is MiniMax-Text-01)
    "minimax": "MiniMaxM2ForCausalLM",
    "minicpm": "MiniCPMForCausalLM",
    "nanbeige": "NanbeigeForCausalLM",
    "nemotron-nas": "DeciLMForCausalLM",
    "openelm": "OpenELMForCausalLM",
    "plamo": "PlamoForCausalLM",
    "plamo2": "Plamo2ForCausalLM",
    "plamo3": "Plamo3ForCausalLM",
    "qwen": "QWenLMHeadModel",
    "step3p5": "Step3p5ForCausalLM",
    "youtu_llm": "YoutuForCausalLM",
}

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def cast_floats(model: nn.Module, dtype: str) -> None:
    """Hold every floating-point parameter of ``model`` in ``dtype`` (a key of DTYPES)."""
    target = DTYPES[dtype]
    params = tree_flatten(model.parameters())
    if any(v.dtype != target and mx.issubdtype(v.dtype, mx.floating) for _, v in params):
        model.set_dtype(target)


def family_classes(config: dict, where: str = "config.json"):
    """mlx-lm's (Model, ModelArgs) classes for a config's model_type, or a UserInputError."""
    # mlx_lm.utils pulls in transformers: imported when a model is built, not with mlxtune
    from mlx_lm.utils import _get_classes

    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise UserInputError("no model_type", where)
    try:
        return _get_classes(config)
    except ValueError:
        raise UserInputError(f"model_type {mt!r} is not a model type mlx-lm knows", where) from None


def _bailing_v2(config: dict) -> bool:
    """Whether a bailing_moe config is Ling 2.0's (BailingMoeV2): query/key norms, or its
    sigmoid router with an expert bias. mlx-lm runs both generations as one model_type; their
    published classes, and llama.cpp's converters, differ."""
    return bool(
        config.get("use_qk_norm")
        or config.get("score_function") == "sigmoid"
        or config.get("moe_router_enable_expert_bias")
    )


# model_type -> (the class a config's settings call for, the test on the config)
_BY_CONFIG = {"bailing_moe": ("BailingMoeV2ForCausalLM", _bailing_v2)}


def hf_architecture(model_type: str, config: dict | None = None) -> str:
    """The transformers class that runs a model_type as a causal LM ("" where transformers has
    none); ``config`` picks between the generations of a model_type published under different
    classes."""
    if config is not None and model_type in _BY_CONFIG:
        name, applies = _BY_CONFIG[model_type]
        if applies(config):
            return name
    if model_type in HF_ARCHITECTURES:
        return HF_ARCHITECTURES[model_type]
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return ""
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")


def shadow(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree that shares its arrays: what is done to the copy's layers and
    weights (adapters merged in, layers de-quantized, weights cast, all lazy) leaves the
    original as it was, and nothing is computed or held twice. An export works on one, so that
    its lazily computed weights are held by nothing but the export and go once written."""
    out = copy.copy(module)
    for k, v in list(out.items()):
        out[k] = _shadowed(v)
    return out


def _shadowed(v):
    if isinstance(v, nn.Module):
        return shadow(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_shadowed(x) for x in v)
    if isinstance(v, dict):
        return {k: _shadowed(x) for k, x in v.items()}
    return v


def derived_class(cls: type, made: dict, prefix: str, doc: str, **attrs) -> type:
    """The subclass of ``cls`` named ``prefix`` + its name with ``attrs`` (a call of its own,
    say), made once per class (``made`` keeps them): what changes a layer's behaviour by
    changing its instance's class, its parameters and names left as they are."""
    if cls not in made:
        body = {"__module__": cls.__module__, "__doc__": doc, **attrs}
        made[cls] = type(f"{prefix}{cls.__name__}", (cls,), body)
    return made[cls]
