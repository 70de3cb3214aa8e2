"""Models: load a Hugging Face layout directory through mlx-lm or a GGUF file, build one from an architecture
config, save one in Hugging Face layout, quantize its base, checkpoint its blocks, patch mlx-lm's
modules for training, and split a model into its backbone and LM head so the loss never needs
the full logits. One module per concern; every name is importable from ``mlxtune.models``."""

from ..gguf.file import is_gguf, read_gguf
from ..safety import PICKLED, code_files, pickled_hint
from .building import build_model, hf_payload, init_weights, save_model, write_hf, write_weights
from .capabilities import packing_refusal, recurrent_caches
from .checkpointing import checkpoint_layers, checkpointed_layers
from .common import (
    DTYPES,
    HF_ARCHITECTURES,
    cast_floats,
    family_classes,
    hf_architecture,
    shadow,
)
from .context import ForwardContext, current, dropout_key, segments
from .gguf.configs import gguf_config
from .gguf.load import GGUFLoad, load_gguf
from .heads import (
    REWARD_HEAD,
    VALUE_HEAD,
    add_reward_head,
    add_value_head,
    has_reward_head,
    reward_head,
    reward_head_aside,
    value_head,
    value_head_aside,
    without_reward_head,
    without_value_head,
)
from .loading import check_model_dir, load_model, resolve_model_path
from .noise import add_embedding_noise, has_embedding_noise
from .parts import LMParts, count_parameters, lm_parts, module_at
from .patches import kernel_attention
from .quantize import (
    DequantizingEmbedding,
    DequantizingLinear,
    cpu_dequantizing,
    dense_weight,
    dequantize_for_training,
    is_quantized,
    quantize_model,
)
from .vision import (
    ImageTokens,
    VisionLM,
    images,
    is_vision_config,
    load_image_tokens,
    load_vision_model,
    step_images,
    write_vision_base,
)
from .vision_families import VISION_FAMILIES, VisionFamily

__all__ = [
    "VISION_FAMILIES",
    "ImageTokens",
    "VisionLM",
    "images",
    "is_vision_config",
    "load_image_tokens",
    "load_vision_model",
    "step_images",
    "write_vision_base",
    "VisionFamily",
    "DTYPES",
    "HF_ARCHITECTURES",
    "PICKLED",
    "REWARD_HEAD",
    "family_classes",
    "hf_architecture",
    "DequantizingEmbedding",
    "DequantizingLinear",
    "ForwardContext",
    "GGUFLoad",
    "LMParts",
    "add_embedding_noise",
    "add_reward_head",
    "build_model",
    "cast_floats",
    "check_model_dir",
    "checkpoint_layers",
    "checkpointed_layers",
    "code_files",
    "count_parameters",
    "cpu_dequantizing",
    "current",
    "dense_weight",
    "dequantize_for_training",
    "dropout_key",
    "gguf_config",
    "has_embedding_noise",
    "has_reward_head",
    "init_weights",
    "is_gguf",
    "is_quantized",
    "kernel_attention",
    "lm_parts",
    "packing_refusal",
    "recurrent_caches",
    "module_at",
    "load_gguf",
    "load_model",
    "pickled_hint",
    "quantize_model",
    "read_gguf",
    "resolve_model_path",
    "reward_head",
    "reward_head_aside",
    "VALUE_HEAD",
    "add_value_head",
    "value_head",
    "value_head_aside",
    "without_value_head",
    "save_model",
    "shadow",
    "hf_payload",
    "write_hf",
    "write_weights",
    "segments",
    "without_reward_head",
]
