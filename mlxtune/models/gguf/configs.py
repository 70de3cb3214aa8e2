"""A model's Hugging Face config read back from a GGUF file's metadata, for each family the
export writes: the keys llama.cpp's loader reads, the tensors the file holds, and what llama.cpp
fixes for the architecture (the export refuses a model that does otherwise)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import UserInputError
from ...gguf.families import FACTS
from ...gguf.names import FAMILIES as NAMED
from ...gguf.rope import rope_freqs_settings, rope_settings
from ..common import family_classes, hf_architecture
from ..configs import STANDARD_NAMES, args_fields
from .settings import FAMILY_SETTINGS
from .whole import (
    deci_config,
    kimi_linear_config,
    mamba2_config,
    mamba_config,
    mimo2_config,
    minicpm3_config,
    mistral4_config,
    mla_config,
    nemotron_h_config,
    openelm_config,
    step35_config,
)

if TYPE_CHECKING:
    from ...gguf.file import GGUFModelFile


# GGUF architecture -> model_type; model types that share an architecture with another and read back as it: mistral as llama,
# mixtral as a "llama" file with experts (below), GLM-4.7-Flash's "deepseek2" as DeepSeek-V3
_SHARED = (
    "mistral", "mixtral", "glm4_moe_lite", "kimi_k2", "olmo3", "qwen2_vl_text", "qwen3_vl_text",
    "qwen3_vl_moe_text", "internlm3", "solar_open",
)  # fmt: skip


FAMILIES = {f.arch: mt for mt, f in NAMED.items() if mt not in _SHARED}
# Qwen2-VL's and Qwen3-VL's language models are mlx-lm's qwen2, qwen3 and qwen3_moe (a text
# position is one rotation)
FAMILIES.update({"qwen2vl": "qwen2", "qwen3vl": "qwen3", "qwen3vlmoe": "qwen3_moe"})


# architectures whose config is built whole (no common attention keys to read)
_WHOLE = {
    "deci": deci_config,
    "kimi-linear": kimi_linear_config,
    "minicpm3": minicpm3_config,
    "step35": step35_config,
    "mistral4": mistral4_config,
    "mimo2": mimo2_config,
    "openelm": openelm_config,
    "mamba": mamba_config,
    "mamba2": mamba2_config,
    "deepseek2": mla_config,
    "nemotron_h_moe": nemotron_h_config,
}
_WHOLE.update({f.names.arch: f.read_config for f in FACTS.values() if f.read_config is not None})
# models with per-layer kv heads (0: a Mamba or short-convolution layer; Gemma 4: per kind)
_KV_PER_LAYER = ("lfm2", "lfm2_moe", "gemma4_text", "granitemoehybrid")


def _model_type(g: GGUFModelFile) -> str:
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
    if arch == "llama" and g.get("expert_count"):
        return "mixtral"
    if arch == "olmo2" and g.get("attention.sliding_window"):  # OLMo 3: OLMo 2 with windows
        return "olmo3"
    return FAMILIES[arch]


def _special_ids(g: GGUFModelFile) -> dict:
    out = {}
    for key, meta in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = g.fields.get(f"tokenizer.ggml.{meta}")
        if isinstance(v, int):
            out[key] = v
    return out


def _heads(g: GGUFModelFile, model_type: str, need) -> tuple[int, int, list | None]:
    """(query heads, kv heads, the kv heads per layer where they differ between layers)."""
    n_head = need("attention.head_count")
    n_kv = g.get("attention.head_count_kv", n_head)
    kv_layers = None
    if model_type in _KV_PER_LAYER and not isinstance(n_kv, int):
        kv_layers = [int(n) for n in n_kv]
        n_kv = max(kv_layers)
    for name, v in (("attention.head_count", n_head), ("attention.head_count_kv", n_kv)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise UserInputError(
                f"{g.arch}.{name} differs between layers; mlxtune reads one value", str(g.path)
            )
    return n_head, n_kv, kv_layers


def gguf_config(g: GGUFModelFile) -> dict:
    """The Hugging Face config of a GGUF model, from its metadata (UserInputError when the
    family or one of its settings is not one mlxtune reads)."""
    model_type, where = _model_type(g), str(g.path)

    def need(key):
        v = g.get(key)
        if v is None:
            raise UserInputError(f"the metadata has no {g.arch}.{key}", where)
        return v

    if g.arch in _WHOLE:
        config = _WHOLE[g.arch](g, need)
        config.setdefault("architectures", [hf_architecture(config["model_type"], config)])
        if "rope_scaling" not in config:  # Llama 3's, as a rope_freqs tensor
            heads = config.get("num_attention_heads") or 1
            head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
            config.update(rope_freqs_settings(g, config, _fields(config), head_dim))
        return {**config, **_special_ids(g)}
    n_head, n_kv, kv_layers = _heads(g, model_type, need)
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
        **_special_ids(g),
    }
    config.update(rope_settings(g, config, _fields(config)))
    if model_type == "gemma2":
        config.update(_gemma2_settings(g, config))
    config.update(_family_settings(g, config, kv_layers))
    # a model_type published under one class a generation: the settings say which
    config["architectures"] = [hf_architecture(model_type, config)]
    return config


# a text model mlx-lm builds only inside its multimodal wrapper -> the wrapper's model_type
WRAPPED = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "llama4": "llama4"}


def _fields(config: dict) -> set[str]:
    """The config keys the family's mlx-lm ModelArgs takes (a wrapped text model's own)."""
    mt = config["model_type"]
    if mt in WRAPPED:
        import importlib

        module = importlib.import_module(f"mlx_lm.models.{WRAPPED[mt]}")
        # the text model's arguments: in the wrapper's module or the one it builds on
        # (Qwen3.5-MoE's wrapper subclasses Qwen3.5's)
        owners = [importlib.import_module(c.__module__) for c in module.Model.__mro__]
        text_args = next(
            getattr(m, name)
            for m in owners
            for name in ("TextModelArgs", "TextArgs")  # Llama 4's: TextArgs
            if hasattr(m, name)
        )
        return args_fields(text_args)
    return args_fields(family_classes(config)[1])


# the key each family's ModelArgs counts its experts under (the rest: num_experts)
_EXPERT_KEY = {
    "mixtral": "num_local_experts",
    "granitemoe": "num_local_experts",
    "granitemoehybrid": "num_local_experts",
    "gpt_oss": "num_local_experts",
    "minimax": "num_local_experts",
    "ernie4_5_moe": "moe_num_experts",
    "dots1": "n_routed_experts",
    "glm4_moe": "n_routed_experts",
    "deepseek": "n_routed_experts",
}
# families whose ModelArgs takes the experts' width, and every layer as an MoE layer
_MOE_WIDTH = ("qwen2_moe", "qwen3_moe", "glm4_moe", "qwen3_next", "qwen3_5_moe_text", "deepseek")
# a family's bias switches, and the tensor whose presence says each is on
_BIASES = {
    "use_qkv_bias": "blk.0.attn_q.bias",
    "attention_bias": "blk.0.attn_q.bias",
    "use_bias": "blk.0.attn_q.bias",
    "bias": "blk.0.attn_q.bias",  # InternLM 2's
    "mlp_bias": "blk.0.ffn_up.bias",
    "attention_out_bias": "blk.0.attn_output.bias",
}


def _experts(g: GGUFModelFile, config: dict) -> dict:
    """A mixture's expert count, top-k and widths."""
    mt, out = config["model_type"], {}
    experts = g.get("expert_count")
    if not experts:
        return out
    out[_EXPERT_KEY.get(mt, "num_experts")] = int(experts)
    out["num_experts_per_tok"] = int(g.get("expert_used_count"))
    width = g.get("expert_feed_forward_length")
    if width is None and "blk.0.ffn_gate_exps.weight" in g.tensors:
        width = int(g.tensors["blk.0.ffn_gate_exps.weight"].shape[1])
    if mt in _MOE_WIDTH:
        out["moe_intermediate_size"] = int(width)
        out["decoder_sparse_step"], out["mlp_only_layers"] = 1, []
    if mt in ("qwen3_moe", "olmoe"):  # what llama.cpp's graph fixes for the architecture
        out["norm_topk_prob"] = NAMED[mt].norm_topk
    if mt == "qwen2_moe":
        shared = g.get("expert_shared_feed_forward_length")
        if shared is None and "blk.0.ffn_gate_shexp.weight" in g.tensors:
            shared = int(g.tensors["blk.0.ffn_gate_shexp.weight"].shape[1])
        out["shared_expert_intermediate_size"] = int(shared or 0)
    return out


def _switches(g: GGUFModelFile, config: dict) -> dict:
    """LayerNorm epsilons, q/k norms, parallel residuals and biases, for the families whose
    ModelArgs takes them, read off the metadata and the tensors the file holds."""
    fields, out = _fields(config), {}
    eps = g.get("attention.layer_norm_epsilon")
    for key in ("layer_norm_eps", "norm_epsilon", "layer_norm_epsilon"):
        if eps is not None and key in fields:
            out[key] = float(eps)
    for key in ("qk_layernorm", "use_qk_norm"):
        if key in fields:
            out[key] = "blk.0.attn_q_norm.weight" in g.tensors
    if "use_parallel_residual" in fields:  # llama.cpp's StableLM: no FFN norm means parallel
        out["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in g.tensors
    for key, tensor in _BIASES.items():
        if key in fields:
            out[key] = tensor in g.tensors
    return out


def _older_names(config: dict) -> dict:
    """The common keys again under the names an older family's ModelArgs takes (GPT-2's
    ``n_layer``), the export's ``standard_config`` undone."""
    fields, out = _fields(config), {}
    for key, olds in STANDARD_NAMES.items():
        for old in olds:
            if old in fields and key in config:
                out[old] = config[key]
    return out


def _family_settings(g: GGUFModelFile, config: dict, kv_layers: list | None) -> dict:
    """The settings of the newer families: experts, switches, and each family's own."""
    own = FAMILY_SETTINGS.get(config["model_type"])
    out = {**_older_names(config), **_experts(g, config), **_switches(g, config)}
    return {**out, **own(g, config, kv_layers)} if own else out


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
