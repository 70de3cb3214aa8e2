"""Loading a GGUF file (llama.cpp's format, as Ollama, LM Studio and llama.cpp keep models) as a
trainable mlx-lm model.

- The config comes from the file's metadata, for every family mlxtune exports to GGUF (llama and
  mistral, qwen2, qwen3, gemma, gemma2, phi3), in the family's Hugging Face form, so the model is
  the same mlx-lm module a Hugging Face directory gives and everything downstream (adapters,
  kernels, exports) treats it alike.
- Tensor names are mapped back with the export's own table (``names.gguf_name``), llama's
  q/k rows are permuted back from llama.cpp's interleaved rope order to rotate-half, and gemma's
  norms lose the 1 llama.cpp's converter adds.
- Q8_0, Q4_0 and Q4_1 are affine codes in blocks of 32 with one scale (and one offset) per block,
  which is exactly what an MLX quantized array holds with ``group_size=32``: such tensors become
  ``QuantizedLinear`` / ``QuantizedEmbedding`` layers without any rounding, when the caller keeps
  them quantized (a LoRA/DoRA base). Every other type (F32, F16, BF16, the K-quants, ...) is
  de-quantized with the ``gguf`` package's reference code and held in the model's dtype.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import UserInputError
from ..models.common import DTYPES, family_classes, hf_architecture
from ..models.configs import args_fields
from ..models.quantize import cpu_dequantizing
from .file import GGUFFile, GGUFTensor, open_gguf
from .names import ARCHES, NORM_PLUS_ONE, SHARED_GATE_UP, gguf_name
from .names import FAMILIES as NAMED
from .rope import llama3_settings

GROUP = 32  # ggml's block size for Q8_0, Q4_0 and Q4_1

# GGUF architecture -> model_type; model types that share an architecture with another and read back as it: mistral as llama,
# mixtral as a "llama" file with experts (below), GLM-4.7-Flash's "deepseek2" as DeepSeek-V3
_SHARED = ("mistral", "mixtral", "glm4_moe_lite", "kimi_k2", "olmo3")
FAMILIES = {f.arch: mt for mt, f in NAMED.items() if mt not in _SHARED}
# architectures whose q/k rows llama.cpp's converter permutes to its interleaved rope order
PERMUTED = tuple({arch for arch, permuted in ARCHES.values() if permuted})
# tensor types held as MLX quantized arrays (bits) when kept quantized
NATIVE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its magic bytes, not its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass
class GGUFModelFile:
    """A GGUF file's metadata and tensors (memory-mapped), with the architecture's keys."""

    file: GGUFFile

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def fields(self) -> dict:
        return self.file.fields

    @property
    def tensors(self) -> dict:
        return self.file.tensors

    @property
    def arch(self) -> str:
        return self.fields.get("general.architecture", "")

    def get(self, key: str, default=None):
        """``<arch>.<key>`` from the metadata."""
        return self.fields.get(f"{self.arch}.{key}", default)


def read_gguf(path: str | Path) -> GGUFModelFile:
    """Open a GGUF model file: its metadata as plain Python values, its tensors by name."""
    return GGUFModelFile(open_gguf(path))


# ------------------------------------------------------------------------------ config


def gguf_config(g: GGUFModelFile) -> dict:
    """The Hugging Face config of a GGUF model, from its metadata (UserInputError when the
    family or one of its settings is not one mlxtune reads)."""
    arch, where = g.arch, str(g.path)
    if g.fields.get("general.type", "model") != "model":
        raise UserInputError(
            f"this GGUF file is a {g.fields.get('general.type')!r}, not a model", where
        )
    if arch not in FAMILIES:
        raise UserInputError(
            f"GGUF architecture {arch!r} is not one mlxtune trains; it reads "
            f"{', '.join(sorted(FAMILIES))}",
            where,
        )

    def need(key):
        v = g.get(key)
        if v is None:
            raise UserInputError(f"the metadata has no {arch}.{key}", where)
        return v

    if arch == "mamba2":
        return _mamba2_config(g, need)
    if arch == "deepseek2":
        return _mla_config(g, need)
    if arch == "nemotron_h_moe":
        return _nemotron_h_config(g, need)
    model_type = FAMILIES[arch]
    if arch == "llama" and g.get("expert_count"):
        model_type = "mixtral"
    if arch == "olmo2" and g.get("attention.sliding_window"):  # OLMo 3: OLMo 2 with windows
        model_type = "olmo3"
    n_head = need("attention.head_count")
    n_kv = g.get("attention.head_count_kv", n_head)
    kv_layers = None
    if model_type in ("lfm2", "lfm2_moe", "gemma4_text", "granitemoehybrid") and not isinstance(
        n_kv, int
    ):
        kv_layers = [int(n) for n in n_kv]  # lfm2: 0 kv heads is a short-conv layer
        n_kv = max(kv_layers)
    for name, v in (("attention.head_count", n_head), ("attention.head_count_kv", n_kv)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise UserInputError(
                f"{arch}.{name} differs between layers; mlxtune reads one value", where
            )
    hidden = need("embedding_length")
    head_dim = g.get("attention.key_length") or hidden // n_head
    if g.get("attention.value_length", head_dim) != head_dim:
        raise UserInputError("key and value head sizes differ; mlxtune reads equal ones", where)
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", where)
    tokens = g.fields.get("tokenizer.ggml.tokens")
    vocab = g.get("vocab_size") or (len(tokens) if tokens is not None else int(embd.shape[-1]))
    config = {
        "model_type": model_type,
        "architectures": [hf_architecture(model_type)],
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "intermediate_size": need("feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    for key, meta in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = g.fields.get(f"tokenizer.ggml.{meta}")
        if isinstance(v, int):
            config[key] = v
    config.update(_rope_settings(g, config))
    if model_type == "gemma2":
        config.update(_gemma2_settings(g, config))
    config.update(_family_settings(g, config, kv_layers))
    return config


def _gemma4_settings(g: GGUFModelFile, config: dict, kv_layers: list | None) -> dict:
    """Gemma 4's layout back from what llama.cpp's gemma4 reads (see the export)."""
    where, layers = str(g.path), config["num_hidden_layers"]
    sliding = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
    if len(sliding) != layers:
        raise UserInputError(f"{g.arch}.attention.sliding_window_pattern is not per layer", where)
    head_swa = int(g.get("attention.key_length_swa", config["head_dim"]))
    head_full = int(g.get("attention.key_length", config["head_dim"]))
    ff = g.get("feed_forward_length")
    ff = [int(x) for x in ff] if not isinstance(ff, int) else [int(ff)] * layers
    shared = int(g.get("attention.shared_kv_layers", 0))
    out = {
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "sliding_window": int(g.get("attention.sliding_window", 512)),
        "final_logit_softcapping": g.get("final_logit_softcapping"),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(g.get("embedding_length_per_layer_input", 0)),
        "intermediate_size": ff[0],
        "use_double_wide_mlp": any(x == 2 * ff[0] for x in ff[layers - shared :])
        if shared
        else False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
    }
    if kv_layers is not None:
        out["num_key_value_heads"] = next(n for n, s in zip(kv_layers, sliding, strict=True) if s)
        out["num_global_key_value_heads"] = next(
            n for n, s in zip(kv_layers, sliding, strict=True) if not s
        )
    per_layer = g.tensors.get("per_layer_token_embd.weight")
    if per_layer is not None:
        out["vocab_size_per_layer_input"] = int(per_layer.shape[-1])
    freqs = g.tensors.get("rope_freqs.weight")
    rotated = head_full // 2
    if freqs is not None:
        rotated = int((dequantized(freqs) < 1e20).sum())
    swa_dims = int(g.get("rope.dimension_count_swa", head_swa))
    out["rope_parameters"] = {
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 2 * rotated / head_full,
            "rope_theta": float(g.get("rope.freq_base", 1e6)),
        },
        "sliding_attention": {
            "rope_type": "default",
            "partial_rotary_factor": swa_dims / head_swa,
            "rope_theta": float(g.get("rope.freq_base_swa", 1e4)),
        },
    }
    return out


# a text model mlx-lm builds only inside its multimodal wrapper -> the wrapper's model_type
WRAPPED = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def _nemotron_h_config(g: GGUFModelFile, need) -> dict:
    """Nemotron-H's config from what llama.cpp's nemotron_h_moe reads: its layer pattern from
    the per-layer kv heads (attention) and FFN widths (experts), Mamba 2 elsewhere."""
    kv = [int(x) for x in need("attention.head_count_kv")]
    ff = [int(x) for x in need("feed_forward_length")]
    pattern = "".join("*" if k else "E" if f else "M" for k, f in zip(kv, ff, strict=True))
    inner, heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", str(g.path))
    has = g.tensors.__contains__
    return {
        "model_type": "nemotron_h",
        "architectures": [hf_architecture("nemotron_h")],
        "vocab_size": int(g.get("vocab_size") or embd.shape[-1]),
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "intermediate_size": max(ff),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "num_attention_heads": int(need("attention.head_count")),
        "num_key_value_heads": max(kv),
        "head_dim": int(need("attention.key_length")),
        "attention_bias": any(has(f"blk.{i}.attn_q.bias") for i in range(len(pattern))),
        "mamba_num_heads": heads,
        "mamba_head_dim": inner // heads,
        "mamba_proj_bias": has("blk.0.ssm_in.bias"),
        "ssm_state_size": int(need("ssm.state_size")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "n_groups": int(g.get("ssm.group_count", 1)),
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": has("blk.0.ssm_conv1d.bias"),
        "layer_norm_epsilon": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "moe_shared_expert_intermediate_size": int(g.get("expert_shared_feed_forward_length", 0)),
        "n_shared_experts": int(g.get("expert_shared_count", 0)),
        "norm_topk_prob": bool(g.get("expert_weights_norm", True)),
        "routed_scaling_factor": float(g.get("expert_weights_scale", 1.0)),
        "n_group": int(g.get("expert_group_count", 1)),
        "topk_group": int(g.get("expert_group_used_count", 1)),
        "time_step_limit": [0.0, float("inf")],
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def _mla_config(g: GGUFModelFile, need) -> dict:
    """DeepSeek-V3's config from what llama.cpp's deepseek2 reads (see the export)."""
    rope = int(need("rope.dimension_count"))
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", str(g.path))
    heads = int(need("attention.head_count"))
    gating = int(g.get("expert_gating_func", 1))
    config = {
        "model_type": "deepseek_v3",
        "architectures": [hf_architecture("deepseek_v3")],
        "vocab_size": int(g.get("vocab_size") or embd.shape[-1]),
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "moe_intermediate_size": int(need("expert_feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_routed_experts": int(need("expert_count")),
        "num_experts_per_tok": int(need("expert_used_count")),
        "n_shared_experts": int(g.get("expert_shared_count", 0)) or None,
        "routed_scaling_factor": float(g.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(g.get("expert_weights_norm", False)),
        "scoring_func": "sigmoid" if gating == 2 else "softmax",
        "n_group": int(g.get("expert_group_count", 1)),
        "topk_group": int(g.get("expert_group_used_count", 1)),
        "first_k_dense_replace": int(g.get("leading_dense_block_count", 0)),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "q_lora_rank": g.get("attention.q_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(need("attention.key_length_mla")) - rope,
        "v_head_dim": int(need("attention.value_length_mla")),
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    if g.get("rope.scaling.type") == "yarn":
        log_mul = float(g.get("rope.scaling.yarn_log_mul", 0.0)) / 0.1
        config["rope_scaling"] = {
            "type": "yarn",
            "factor": float(need("rope.scaling.factor")),
            "original_max_position_embeddings": int(need("rope.scaling.original_context_length")),
            "beta_fast": float(g.get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(g.get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": log_mul,
            "mscale_all_dim": log_mul,
        }
    return config


def _mamba2_config(g: GGUFModelFile, need) -> dict:
    """Mamba 2's config from what llama.cpp's mamba2 reads (no attention, no MLP)."""
    inner, heads = int(need("ssm.inner_size")), int(need("ssm.time_step_rank"))
    embd = g.tensors.get("token_embd.weight")
    if embd is None:
        raise UserInputError("no token_embd.weight tensor", str(g.path))
    return {
        "model_type": "mamba2",
        "architectures": [hf_architecture("mamba2")],
        "vocab_size": int(g.get("vocab_size") or embd.shape[-1]),
        "hidden_size": int(need("embedding_length")),
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": inner,
        "num_heads": heads,
        "head_dim": inner // heads,
        "state_size": int(need("ssm.state_size")),
        "conv_kernel": int(need("ssm.conv_kernel")),
        "n_groups": int(g.get("ssm.group_count", 1)),
        "layer_norm_epsilon": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "use_bias": "blk.0.ssm_in.bias" in g.tensors,
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in g.tensors,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "time_step_limit": [0.0, float("inf")],
        "time_step_rank": heads,
        "max_position_embeddings": int(g.get("context_length", 2048)),
    }


def _ssm_columns(g: GGUFModelFile, config: dict) -> None:
    """Mamba 2's A, D and gated norm back in mlx-lm's form: A_log from A, each a vector."""
    for i in range(config["num_hidden_layers"]):
        for name, fix in (
            ("ssm_a", lambda x: np.log(-x).reshape(-1)),
            ("ssm_d", lambda x: x.reshape(-1)),
            ("ssm_norm.weight", lambda x: x.reshape(-1)),
        ):
            t = g.tensors.get(f"blk.{i}.{name}")
            if t is not None:
                g.tensors[f"blk.{i}.{name}"] = _plain(f"blk.{i}.{name}", fix(dequantized(t)))


def _fields(config: dict) -> set[str]:
    """The config keys the family's mlx-lm ModelArgs takes (a wrapped text model's own)."""
    mt = config["model_type"]
    if mt in WRAPPED:
        import importlib

        module = importlib.import_module(f"mlx_lm.models.{WRAPPED[mt]}")
        # the text model's arguments: in the wrapper's module or the one it builds on
        # (Qwen3.5-MoE's wrapper subclasses Qwen3.5's)
        owners = [importlib.import_module(c.__module__) for c in module.Model.__mro__]
        text_args = next(m.TextModelArgs for m in owners if hasattr(m, "TextModelArgs"))
        return args_fields(text_args)
    return args_fields(family_classes(config)[1])


def _family_settings(g: GGUFModelFile, config: dict, kv_layers: list | None) -> dict:
    """The settings of the newer families, from their metadata, tensors, and what llama.cpp
    fixes for their architecture (the export refuses a model that does otherwise)."""
    mt, out = config["model_type"], {}
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    experts = g.get("expert_count")
    if experts:
        key = {
            "mixtral": "num_local_experts",
            "granitemoe": "num_local_experts",
            "granitemoehybrid": "num_local_experts",
        }.get(mt, "num_experts")
        key = {"gpt_oss": "num_local_experts", "glm4_moe": "n_routed_experts"}.get(mt, key)
        key = "n_routed_experts" if mt == "deepseek" else key
        out[key] = int(experts)
        out["num_experts_per_tok"] = int(g.get("expert_used_count"))
        width = g.get("expert_feed_forward_length")
        if width is None and "blk.0.ffn_gate_exps.weight" in g.tensors:
            width = int(g.tensors["blk.0.ffn_gate_exps.weight"].shape[1])
        if mt in (
            "qwen2_moe",
            "qwen3_moe",
            "glm4_moe",
            "qwen3_next",
            "qwen3_5_moe_text",
            "deepseek",
        ):
            out["moe_intermediate_size"] = int(width)
            out["decoder_sparse_step"], out["mlp_only_layers"] = 1, []
        if NAMED[mt].norm_topk is not None and mt in ("qwen3_moe", "olmoe"):
            out["norm_topk_prob"] = NAMED[mt].norm_topk
        if mt == "qwen2_moe":
            shared = g.get("expert_shared_feed_forward_length")
            if shared is None and "blk.0.ffn_gate_shexp.weight" in g.tensors:
                shared = int(g.tensors["blk.0.ffn_gate_shexp.weight"].shape[1])
            out["shared_expert_intermediate_size"] = int(shared or 0)
    fields = _fields(config)
    eps = g.get("attention.layer_norm_epsilon")
    for key in ("layer_norm_eps", "norm_epsilon", "layer_norm_epsilon"):
        if eps is not None and key in fields:  # a LayerNorm family's epsilon
            out[key] = float(eps)
    if "qk_layernorm" in fields:
        out["qk_layernorm"] = "blk.0.attn_q_norm.weight" in g.tensors
    if "use_parallel_residual" in fields:  # llama.cpp's StableLM: no FFN norm means parallel
        out["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in g.tensors
    biases = {  # a family's bias switches, read off the tensors the file holds
        "use_qkv_bias": "blk.0.attn_q.bias",
        "attention_bias": "blk.0.attn_q.bias",
        "use_bias": "blk.0.attn_q.bias",
        "mlp_bias": "blk.0.ffn_up.bias",
        "attention_out_bias": "blk.0.attn_output.bias",
    }
    for key, tensor in biases.items():
        if key in fields:
            out[key] = tensor in g.tensors
    if mt == "granitemoehybrid":
        out.update(
            layer_types=["attention" if n else "mamba" for n in kv_layers or [1] * layers],
            mamba_n_heads=int(g.get("ssm.time_step_rank")),
            mamba_d_head=int(g.get("ssm.inner_size")) // int(g.get("ssm.time_step_rank")),
            mamba_d_state=int(g.get("ssm.state_size")),
            mamba_d_conv=int(g.get("ssm.conv_kernel")),
            mamba_n_groups=int(g.get("ssm.group_count", 1)),
            mamba_proj_bias=any(f"blk.{i}.ssm_in.bias" in g.tensors for i in range(layers)),
            mamba_conv_bias=any(f"blk.{i}.ssm_conv1d.bias" in g.tensors for i in range(layers)),
            shared_intermediate_size=int(g.get("expert_shared_feed_forward_length", 0)),
            position_embedding_type="rope" if g.get("rope.scaling.finetuned", True) else "nope",
            time_step_limit=[0.0, float("inf")],
        )
    if mt in ("granite", "granitemoe", "granitemoehybrid"):
        for key, meta in (
            ("attention_multiplier", "attention.scale"),
            ("embedding_multiplier", "embedding_scale"),
            ("residual_multiplier", "residual_scale"),
            ("logits_scaling", "logit_scale"),
        ):
            out[key] = float(g.get(meta, 1.0))
    if mt == "gemma4_text":
        out.update(_gemma4_settings(g, config, kv_layers))
    if mt == "qwen3_5_moe_text":
        out["shared_expert_intermediate_size"] = int(g.get("expert_shared_feed_forward_length", 0))
        out["norm_topk_prob"] = True
    if mt in ("qwen3_5_text", "qwen3_5_moe_text"):
        out.update(
            linear_conv_kernel_dim=int(g.get("ssm.conv_kernel")),
            linear_key_head_dim=int(g.get("ssm.state_size")),
            linear_num_key_heads=int(g.get("ssm.group_count")),
            linear_num_value_heads=int(g.get("ssm.time_step_rank")),
            linear_value_head_dim=int(g.get("ssm.inner_size")) // int(g.get("ssm.time_step_rank")),
            full_attention_interval=int(g.get("full_attention_interval", 4)),
        )
    if mt == "qwen3_next":
        out.update(
            linear_conv_kernel_dim=int(g.get("ssm.conv_kernel")),
            linear_key_head_dim=int(g.get("ssm.state_size")),
            linear_num_key_heads=int(g.get("ssm.group_count")),
            linear_num_value_heads=int(g.get("ssm.time_step_rank")),
            linear_value_head_dim=int(g.get("ssm.inner_size")) // int(g.get("ssm.time_step_rank")),
            full_attention_interval=int(g.get("full_attention_interval", 4)),
            shared_expert_intermediate_size=int(g.get("expert_shared_feed_forward_length", 0)),
            norm_topk_prob=True,
        )
    if mt == "glm4_moe":
        out.update(
            n_shared_experts=int(g.get("expert_shared_count", 0)),
            first_k_dense_replace=int(g.get("leading_dense_block_count", 0)),
            norm_topk_prob=bool(g.get("expert_weights_norm", True)),
            routed_scaling_factor=float(g.get("expert_weights_scale", 1.0)),
            n_group=int(g.get("expert_group_count", 1)),
            topk_group=int(g.get("expert_group_used_count", 1)),
            use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
            attention_bias="blk.0.attn_q.bias" in g.tensors,
            rope_scaling=config.get("rope_scaling"),  # a key its ModelArgs requires
        )
    if mt == "gpt_oss":  # llama.cpp's: a window on even layers, full attention on odd ones
        out.update(
            intermediate_size=int(g.get("expert_feed_forward_length", config["intermediate_size"])),
            sliding_window=int(g.get("attention.sliding_window")),
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],
        )
    if mt == "deepseek":
        out.update(
            n_shared_experts=g.get("expert_shared_count"),
            first_k_dense_replace=int(g.get("leading_dense_block_count", 0)),
            moe_layer_freq=1,
        )
    if mt == "ministral3":  # its RoPE settings go in rope_parameters
        scaling = config.get("rope_scaling") or {}
        rp = {"rope_type": "default", "rope_theta": config["rope_theta"]}
        if scaling.get("rope_type") == "yarn":
            log_mul = float(g.get("rope.scaling.yarn_log_mul", 1.0))
            rp = {
                **scaling,
                **rp,
                "rope_type": "yarn",
                "mscale": log_mul,
                "mscale_all_dim": log_mul,
            }
            beta = g.get("attention.temperature_scale")
            if beta is not None:
                rp["llama_4_scaling_beta"] = float(beta)
        out.update(rope_parameters=rp, rope_scaling=None, sliding_window=None)
    if mt == "olmo3":
        pattern = [bool(x) for x in g.get("attention.sliding_window_pattern", [])]
        if len(pattern) != layers:  # llama.cpp's default: every 4th layer full
            pattern = [(i + 1) % 4 != 0 for i in range(layers)]
        out.update(
            sliding_window=int(g.get("attention.sliding_window")),
            layer_types=["sliding_attention" if p else "full_attention" for p in pattern],
        )
    if mt == "nemotron":  # llama.cpp's nemotron: squared ReLU, LayerNorm1P
        out.update(hidden_act="relu2", norm_eps=float(g.get("attention.layer_norm_epsilon", 1e-5)))
    if mt == "minicpm":
        out.update(
            scale_emb=float(g.get("embedding_scale", 1.0)),
            scale_depth=float(g.get("residual_scale", 1.0)) * layers**0.5,
            dim_model_base=round(config["hidden_size"] / float(g.get("logit_scale", 1.0))),
        )
    if mt == "smollm3":
        out["no_rope_layer_interval"] = 4  # llama.cpp's smollm3 leaves every 4th layer unroped
    if mt == "gemma3_text":
        big = layers == 62  # llama.cpp scales the 27B model's queries by hidden / heads
        out.update(
            sliding_window=int(g.get("attention.sliding_window", 512)),
            sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=float(
                config["hidden_size"] // config["num_attention_heads"] if big else head_dim
            ),
        )
        if g.get("final_logit_softcapping"):
            out["final_logit_softcapping"] = float(g.get("final_logit_softcapping"))
    if mt == "lfm2_moe":
        full = [i for i, n in enumerate(kv_layers or [1] * layers) if n > 0]
        out.update(
            full_attn_idxs=full,
            conv_L_cache=int(g.get("shortconv.l_cache", 3)),
            conv_bias="blk.0.shortconv.conv.bias" in g.tensors,
            norm_eps=config["rms_norm_eps"],
            num_dense_layers=int(g.get("leading_dense_block_count", 0)),
            moe_intermediate_size=int(g.get("expert_feed_forward_length")),
            norm_topk_prob=True,
            use_expert_bias=any(".exp_probs_b." in n for n in g.tensors),
        )
    if mt == "lfm2":
        full = [i for i, n in enumerate(kv_layers or [1] * layers) if n > 0]
        out.update(
            full_attn_idxs=full,
            conv_L_cache=int(g.get("shortconv.l_cache", 3)),
            conv_bias="blk.0.shortconv.conv.bias" in g.tensors
            or any(f"blk.{i}.shortconv.in_proj.bias" in g.tensors for i in range(layers)),
            norm_eps=config["rms_norm_eps"],
            block_dim=config["hidden_size"],
            block_ff_dim=config["intermediate_size"],
            block_auto_adjust_ff_dim=False,
            block_multiple_of=1,
            block_ffn_dim_multiplier=1.0,
        )
    return out


def _rope_settings(g: GGUFModelFile, config: dict) -> dict:
    """Partial rotary (phi3) and linear rope scaling; what mlxtune cannot read is refused."""
    where, head_dim, out = str(g.path), config["head_dim"], {}
    rope_dims = g.get("rope.dimension_count", head_dim)
    if config["model_type"] == "phi3":
        out["partial_rotary_factor"] = rope_dims / head_dim
        out["original_max_position_embeddings"] = int(
            g.get("rope.scaling.original_context_length") or config["max_position_embeddings"]
        )
        if "rope_factors_long.weight" in g.tensors:
            raise UserInputError(
                "this phi3 model uses long-context rope factors (LongRoPE), which mlxtune "
                "does not read from GGUF yet",
                where,
            )
    elif config["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text"):
        sections = [int(x) for x in g.get("rope.dimension_sections", [])][:3]
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": config["rope_theta"],
            "partial_rotary_factor": rope_dims / head_dim,
            "mrope_section": sections or [rope_dims // 2, 0, 0],
        }
    elif rope_dims != head_dim and "partial_rotary_factor" in _fields(config):
        out["partial_rotary_factor"] = rope_dims / head_dim
    elif rope_dims != head_dim:
        raise UserInputError(
            f"{g.arch}.rope.dimension_count is {rope_dims}, not the head size {head_dim}, and "
            f"mlx-lm's {config['model_type']} rotates whole heads",
            where,
        )
    scaling = g.get("rope.scaling.type")
    if scaling not in (None, "none"):
        factor = g.get("rope.scaling.factor")
        original = g.get("rope.scaling.original_context_length")
        if scaling == "linear" and factor is not None:
            out["rope_scaling"] = {"type": "linear", "factor": float(factor)}
        elif scaling == "yarn" and factor is not None and original is not None:
            out["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": float(factor),
                "original_max_position_embeddings": int(original),
                "beta_fast": float(g.get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g.get("rope.scaling.yarn_beta_slow", 1.0)),
            }
            for key in ("yarn_ext_factor", "yarn_attn_factor"):
                if g.get(f"rope.scaling.{key}") not in (None, 1.0):
                    raise UserInputError(
                        f"{g.arch}.rope.scaling.{key} is not 1, which mlx-lm's yarn cannot run",
                        where,
                    )
        else:
            raise UserInputError(
                f"rope scaling {scaling!r} is not read from GGUF (linear with a factor, and yarn "
                "with its original context, are)",
                where,
            )
    if "rope_freqs.weight" in g.tensors and config["model_type"] != "gemma4_text":
        settings = None
        if config["model_type"] == "llama" and scaling in (None, "none"):
            factors = dequantized(g.tensors["rope_freqs.weight"])
            settings = llama3_settings(factors, config["rope_theta"], head_dim)
        if settings is None:
            raise UserInputError(
                "this model scales its rope frequencies per dimension (rope_freqs) in a way "
                "that is not Llama 3's, which mlxtune does not read",
                where,
            )
        out["rope_scaling"] = settings
    return out


def _gemma2_settings(g: GGUFModelFile, config: dict) -> dict:
    # llama.cpp scales gemma2 queries by 1/sqrt(head size), except the 27B model's (46 blocks)
    # by 1/sqrt(hidden / heads), which is what its config says
    big = config["num_hidden_layers"] == 46
    return {
        "attn_logit_softcapping": float(g.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(g.get("final_logit_softcapping", 30.0)),
        "sliding_window": int(g.get("attention.sliding_window", 4096)),
        "query_pre_attn_scalar": float(
            config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
        ),
    }


def _name_table(model: nn.Module, model_type: str) -> dict[str, str]:
    """GGUF tensor name -> parameter name, for every parameter the model has."""
    table, n_blocks = {}, len(model.layers)
    for hf, _ in tree_flatten(model.parameters()):
        g = gguf_name(hf.removeprefix("language_model."), model_type, n_blocks)
        if g is not None:
            table[g] = hf
    return table


def _unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from llama.cpp's interleaved order back to rotate-half (the
    inverse of ``export.permute_qk``); works on any trailing shape, codes and scales too."""
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _blocks(t, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols] uint8, scales, offsets [rows, cols // 32] float32) of a Q8_0, Q4_0 or
    Q4_1 tensor, so that weight = scale * code + offset in each block of 32."""
    raw = np.asarray(t.data)  # [rows, bytes per row], uint8
    rows = raw.shape[0]
    block = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    b = raw.reshape(rows, -1, block)
    d = b[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = b[..., 2:].copy().view(np.int8).astype(np.int16) + 128  # int8 -> unsigned
        return q.astype(np.uint8).reshape(rows, -1), d, -128.0 * d
    if kind == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
    else:
        m, qs = -8.0 * d, b[..., 2:]
    # a block's 16 bytes hold elements j (low nibble) and j + 16 (high nibble)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return q.reshape(rows, -1), d, m


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes [rows, cols] as MLX packs them: 32 // bits per uint32, the first in the low bits."""
    per = 32 // bits
    c = codes.astype(np.uint32).reshape(codes.shape[0], -1, per)
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(c << shifts, axis=-1)


def dequantized(t) -> np.ndarray:
    """A GGUF tensor as float32 in [rows, cols] (numpy) order, whatever its type."""
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists the innermost dim first
    if t.data.dtype != np.uint8:  # a plain float (or int) array
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    try:
        out = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType(t.type))
    except NotImplementedError:
        raise UserInputError(
            f"tensor {t.name} is {t.type_name}, a type mlxtune cannot de-quantize", "model.path"
        ) from None
    return np.asarray(out, dtype=np.float32).reshape(shape)


@dataclass
class GGUFLoad:
    """What ``load_gguf`` did: tensors kept quantized (bits per name) and de-quantized (type
    per name), and the bytes the weights take as held."""

    quantized: dict[str, int]
    dequantized: dict[str, str]
    nbytes: int

    def summary(self, dtype: str) -> str:
        """One line on what loading did with the file's tensors."""
        parts = []
        if self.quantized:
            bits = _tally(self.quantized, "at {} bits")
            parts.append(f"{len(self.quantized)} weights kept quantized ({bits}, groups of 32)")
        if self.dequantized:
            kinds = _tally(self.dequantized, "{}")
            parts.append(f"{len(self.dequantized)} de-quantized to {dtype} ({kinds})")
        parts.append(f"weights {self.nbytes / 1e9:.3f} GB as held")
        return "; ".join(parts)


def _tally(values: dict, label: str) -> str:
    """'3 at 4 bits, 1 at 8 bits': how many of each value."""
    counts = Counter(values.values())
    return ", ".join(f"{n} {label.format(v)}" for v, n in sorted(counts.items()))


def load_gguf(
    path: str | Path, dtype: str = "float32", keep_quantized: bool = False
) -> tuple[nn.Module, dict, GGUFLoad]:
    """A GGUF model file as (mlx-lm model, Hugging Face config, what was done).

    With ``keep_quantized``, Q8_0/Q4_0/Q4_1 linear and embedding weights become MLX quantized
    layers holding the file's codes, scales and offsets exactly (QLoRA over the file as it
    is); otherwise, and for every other type, weights are de-quantized to ``dtype``.
    """
    g = read_gguf(path)
    where = str(g.path)
    config = gguf_config(g)
    text_type = config["model_type"]
    if text_type in WRAPPED:  # mlx-lm builds this text model inside its wrapper only
        config = {"model_type": WRAPPED[text_type], "text_config": config}
    model_class, args_class = family_classes(config)
    try:
        model = model_class(args_class.from_dict(config))
    except Exception as e:
        raise UserInputError(
            f"cannot build the model its metadata describes: {type(e).__name__}: {e}", where
        ) from None
    if g.arch == "qwen3next":
        _gather_linear_attention(g, config)
    if g.arch in ("mamba2", "nemotron_h_moe", "granitehybrid"):
        _ssm_columns(g, config)
    if g.arch == "granitehybrid":  # Granite's shared MLP: gate and up in one matrix again
        for i in range(config["num_hidden_layers"]):
            gate = g.tensors.pop(f"blk.{i}.ffn_gate_shexp.weight", None)
            if gate is not None:
                up = dequantized(g.tensors.pop(f"blk.{i}.ffn_up_shexp.weight"))
                name = f"blk.{i}.{SHARED_GATE_UP}.weight"
                g.tensors[name] = _plain(name, np.concatenate([dequantized(gate), up]))
    if g.arch in ("qwen35", "qwen35moe"):
        _untile_v_heads(g, config["text_config"])
    table = _name_table(model, text_type)
    _check_tensor_names(g, table, text_type)
    quant = _kept_quantized(g, table, model) if keep_quantized else {}
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: (
                {"group_size": GROUP, "bits": quant[p], "mode": "affine"} if p in quant else False
            ),
        )
    done = GGUFLoad({}, {}, 0)
    weights = _weights(g, table, config.get("text_config", config), quant, DTYPES[dtype], done)
    try:
        model.load_weights(weights, strict=True)
    except ValueError as e:
        raise UserInputError(f"the file's tensors do not fit its config: {e}", where) from None
    mx.eval(model.parameters())
    cpu_dequantizing(model)
    done.nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return model, config, done


def _gather_linear_attention(g: GGUFModelFile, config: dict) -> None:
    """Qwen3-Next's gated delta-net tensors back in mlx-lm's form (the export's inverse): the
    q/k/v projection and z gate as one projection grouped per key head, A_log from A."""
    nk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]
    nv, dv = config["linear_num_value_heads"], config["linear_value_head_dim"]
    per = [dk, dk, nv // nk * dv, nv // nk * dv]
    for i in range(config["num_hidden_layers"]):
        qkv, gate = g.tensors.pop(f"blk.{i}.attn_qkv.weight", None), None
        if qkv is not None:
            gate = g.tensors.pop(f"blk.{i}.attn_gate.weight")
            qkv, z = dequantized(qkv), dequantized(gate)
            q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk], axis=0)
            parts = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
            fused = np.concatenate(parts, axis=1).reshape(nk * sum(per), -1)
            g.tensors[f"blk.{i}.ssm_in.weight"] = _plain(f"blk.{i}.ssm_in.weight", fused)
        a = g.tensors.pop(f"blk.{i}.ssm_a", None)
        if a is not None:
            g.tensors[f"blk.{i}.ssm_a"] = _plain(f"blk.{i}.ssm_a", np.log(-dequantized(a)))


def _untile_v_heads(g: GGUFModelFile, text: dict) -> None:
    """Qwen3.5's gated delta-net tensors back in mlx-lm's form (the export's inverse): V heads
    grouped by key head again, A_log from A."""
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    qk = 2 * nk * dk

    def grouped(a: np.ndarray, axis: int, head_dim: int) -> np.ndarray:
        moved = np.moveaxis(a, axis, 0)
        back = moved.reshape(nv // nk, nk, head_dim, *moved.shape[1:]).swapaxes(0, 1)
        return np.moveaxis(back.reshape(moved.shape), 0, axis)

    for i in range(text["num_hidden_layers"]):
        a = g.tensors.pop(f"blk.{i}.ssm_a", None)
        if a is None:
            continue
        edits = {f"blk.{i}.ssm_a": np.log(-grouped(dequantized(a), 0, 1))}
        for name, axis, head_dim, skip in (
            ("attn_qkv.weight", 0, dv, qk),
            ("ssm_conv1d.weight", 0, dv, qk),
            ("attn_gate.weight", 0, dv, 0),
            ("ssm_beta.weight", 0, 1, 0),
            ("ssm_alpha.weight", 0, 1, 0),
            ("ssm_dt.bias", 0, 1, 0),
            ("ssm_out.weight", 1, dv, 0),
        ):
            t = g.tensors.get(f"blk.{i}.{name}")
            if t is None or nk == nv:
                continue
            x = dequantized(t)
            edits[f"blk.{i}.{name}"] = np.concatenate([x[:skip], grouped(x[skip:], axis, head_dim)])
        for name, x in edits.items():
            g.tensors[name] = _plain(name, x)


def _plain(name: str, a: np.ndarray) -> GGUFTensor:
    """A float32 tensor made here, held as the file's plain tensors are."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return GGUFTensor(name, 0, tuple(reversed(a.shape)), a)


def _check_tensor_names(g: GGUFModelFile, table: dict[str, str], model_type: str) -> None:
    """Every tensor of the file has a place in the model, and every parameter a tensor."""

    def first(names: list[str]) -> str:
        return names[0] + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")

    unknown = sorted(set(g.tensors) - set(table) - {"rope_freqs.weight"})
    if unknown:
        raise UserInputError(
            f"tensor {first(unknown)} has no place in a {model_type} model", str(g.path)
        )
    missing = sorted(set(table) - set(g.tensors))
    if missing:
        raise UserInputError(f"the file has no tensor {first(missing)}", str(g.path))


def _kept_quantized(g: GGUFModelFile, table: dict[str, str], model: nn.Module) -> dict[str, int]:
    """Module path -> bits, for the linear and embedding layers whose weight the file holds as
    Q8_0, Q4_0 or Q4_1."""
    modules = dict(model.named_modules())
    quant = {}
    for gname, hf in table.items():
        kind, mod = g.tensors[gname].type_name, hf.rsplit(".", 1)[0]
        if (
            kind in NATIVE_BITS
            and hf.endswith(".weight")
            and isinstance(modules.get(mod), (nn.Linear, nn.Embedding))
        ):
            quant[mod] = NATIVE_BITS[kind]
    return quant


def _weights(g, table, config, quant, target, done: GGUFLoad) -> list[tuple[str, mx.array]]:
    """(parameter name, array) for every tensor: the codes, scales and offsets of a kept
    quantized weight, every other tensor de-quantized to ``target``; q/k rows back in
    rotate-half order and gemma norms without llama.cpp's 1. Records each in ``done``."""
    heads = {"attn_q.weight": config.get("num_attention_heads")}
    heads["attn_k.weight"] = config.get("num_key_value_heads")
    heads["attn_q.bias"], heads["attn_k.bias"] = heads["attn_q.weight"], heads["attn_k.weight"]
    weights = []
    for gname, hf in table.items():
        t = g.tensors[gname]
        kind, mod = t.type_name, hf.rsplit(".", 1)[0]
        h = heads.get(gname.split(".", 2)[-1]) if g.arch in PERMUTED else None
        if mod in quant and hf.endswith(".weight"):
            codes, scales, offsets = _blocks(t, kind)
            if h is not None:
                codes, scales, offsets = (_unpermute_rows(a, h) for a in (codes, scales, offsets))
            weights += [
                (hf, mx.array(_pack(codes, quant[mod]))),
                (f"{mod}.scales", mx.array(scales).astype(target)),
                (f"{mod}.biases", mx.array(offsets).astype(target)),
            ]
            done.quantized[gname] = quant[mod]
            continue
        a = dequantized(t)
        if h is not None:
            a = _unpermute_rows(a, h)
        if config["model_type"] in NORM_PLUS_ONE and gname.endswith("norm.weight"):
            a = a - 1.0
        if gname.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):  # -> MLX [C, K, 1]
            a = a[..., None]
        weights.append((hf, mx.array(a).astype(target)))
        if kind != "F32":
            done.dequantized[gname] = kind
    return weights
