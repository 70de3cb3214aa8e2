"""The metadata a GGUF file of each family holds, as llama.cpp's converter writes it and its
loader reads it: the common keys and each family's own (``writers`` holds the families written
whole; ``fixed`` what llama.cpp fixes per architecture, refused by name where a model differs)."""

from __future__ import annotations

import numpy as np
from mlx.utils import tree_flatten

from ...errors import UserInputError
from ...gguf.families import FACTS
from ...gguf.names import FAMILIES, gguf_name
from ...gguf.rope import LLAMA3_ROPE_ARCHS, llama3_rope_factors
from ...models.configs import rope_base
from .fixed import exaone4_local, model_args
from .writers import (
    add_deci,
    add_falcon_h1,
    add_gemma4,
    add_granite_hybrid,
    add_kimi_linear,
    add_mamba,
    add_mamba2,
    add_mimo2,
    add_minicpm3,
    add_mla,
    add_nemotron_h,
    add_openelm,
    add_routing,
    add_step35,
)


def head_counts(config: dict) -> tuple[int, int, int]:
    if "num_attention_heads" not in config:  # an attention-free model (Mamba 2)
        return 0, 0, 0
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    if config.get("n_shared_head"):  # PLaMo's: each kv head shared by n_shared_head q heads
        n_kv = -(-n_head // int(config["n_shared_head"]))
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    return n_head, n_kv, head_dim


def _reader(args, config: dict):
    """``arg(name, default)``: the built model's setting, else the config's."""

    def arg(name, default=None):
        v = getattr(args, name, None)
        return config.get(name, default) if v is None else v

    return arg


def _kv_heads(mt: str, arg, n_kv: int, layers: int):
    """The kv heads: one number, or per layer where some layers have none (a Mamba or
    short-convolution layer)."""
    if mt == "granitemoehybrid":
        return [n_kv if t == "attention" else 0 for t in arg("layer_types")]
    if mt in ("lfm2", "lfm2_moe"):
        full = set(arg("full_attn_idxs") or [])
        return [n_kv if i in full else 0 for i in range(layers)]
    return n_kv


def _add_experts(w, arg, mt: str) -> None:
    experts = (
        arg("num_experts")
        or arg("num_local_experts")
        or arg("n_routed_experts")
        or arg("moe_num_experts")
    )
    if not experts:
        return
    w.add_expert_count(int(experts))
    w.add_expert_used_count(int(arg("num_experts_per_tok") or arg("moe_k")))
    if arg("moe_intermediate_size"):
        w.add_expert_feed_forward_length(int(arg("moe_intermediate_size")))
    if arg("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(arg("shared_expert_intermediate_size")))
    if arg("n_shared_experts") is not None:  # DeepSeek-style shared experts
        w.add_expert_shared_count(int(arg("n_shared_experts")))
    if arg("first_k_dense_replace") is not None:  # and leading dense blocks
        w.add_leading_dense_block_count(int(arg("first_k_dense_replace")))


def _layer_norm_eps(w, arg, mt: str) -> None:
    """A LayerNorm family's epsilon (StableLM, StarCoder2, Nemotron's norm_eps)."""
    eps = arg("layer_norm_eps") or arg("norm_epsilon") or arg("layer_norm_epsilon")
    if mt == "nemotron":
        eps = arg("norm_eps")
    if eps is not None:
        w.add_layer_norm_eps(float(eps))


def _sliding(w, arg, config: dict) -> None:
    """Gemma 2/3's, gpt-oss's and OLMo 3's windows (and the first two's soft caps)."""
    mt = config["model_type"]
    if mt == "gemma2":
        w.add_attn_logit_softcapping(float(arg("attn_logit_softcapping", 50.0)))
        w.add_final_logit_softcapping(float(arg("final_logit_softcapping", 30.0)))
        w.add_sliding_window(int(config.get("sliding_window") or 4096))
        return
    w.add_sliding_window(int(arg("sliding_window")))
    if mt == "gpt_oss":
        w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    if mt == "olmo3":  # OLMo 2 with a window on the layer_types' sliding layers
        w.add_sliding_window_pattern([t == "sliding_attention" for t in arg("layer_types")])
    if mt == "gemma3_text" and arg("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(arg("final_logit_softcapping")))


def _short_conv(w, arg, config: dict) -> None:
    """LFM2's short-convolution cache; LFM2-MoE's leading dense blocks and sigmoid routing."""
    import gguf

    w.add_shortconv_l_cache(int(arg("conv_L_cache")))
    if config["model_type"] == "lfm2_moe":
        w.add_leading_dense_block_count(int(arg("num_dense_layers")))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _delta_net(w, arg, config: dict) -> None:
    """Qwen3-Next's and Qwen3.5's gated delta-net layers between every interval-th full one."""
    w.add_ssm_conv_kernel(int(arg("linear_conv_kernel_dim")))
    w.add_ssm_state_size(int(arg("linear_key_head_dim")))
    w.add_ssm_group_count(int(arg("linear_num_key_heads")))
    w.add_ssm_time_step_rank(int(arg("linear_num_value_heads")))
    w.add_ssm_inner_size(int(arg("linear_value_head_dim") * arg("linear_num_value_heads")))
    w.add_full_attention_interval(int(arg("full_attention_interval")))
    if config["model_type"] != "qwen3_next":  # multimodal RoPE sections (text: any split is one)
        head_dim = head_counts(config)[2]
        rp = arg("rope_parameters") or {}
        rot = int(head_dim * float(arg("partial_rotary_factor") or 1.0)) // 2
        sections = list(rp.get("mrope_section") or [rot])
        w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _glm4_moe(w, arg, config: dict) -> None:
    """Sigmoid routing with a correction bias, grouped, scaled, renormalised."""

    scale = arg("routed_scaling_factor") or 1.0  # (shared experts, dense layers: _add_experts)
    add_routing(w, True, scale, arg("norm_topk_prob"), arg("n_group"), arg("topk_group"))
    w.add_nextn_predict_layers(0)  # mlx-lm keeps no multi-token-prediction layer


def _exaone4(w, arg, config: dict) -> None:
    """EXAONE 4's local layers (roped, windowed) beside its global ones (unroped)."""
    local = exaone4_local(arg)
    if local is not None:
        w.add_sliding_window(int(arg("sliding_window")))
        w.add_sliding_window_pattern(local)


def _ernie_moe(w, arg, config: dict) -> None:
    """ERNIE 4.5's experts from layer moe_layer_start_index on, beside a shared MLP as wide as
    its shared experts together."""
    w.add_interleave_moe_layer_step(int(arg("moe_layer_interval", 1)))
    w.add_leading_dense_block_count(int(arg("moe_layer_start_index", 0)))
    shared = int(arg("moe_num_shared_experts", 0) or 0)
    w.add_expert_shared_count(shared)
    if shared:
        w.add_expert_shared_feed_forward_length(shared * int(arg("moe_intermediate_size")))


def _dots1(w, arg, config: dict) -> None:
    """dots.llm1: sigmoid routing with the correction bias, grouped, scaled, renormalised as
    the config says."""

    w.add_leading_dense_block_count(int(arg("first_k_dense_replace", 0)))
    w.add_expert_shared_count(int(arg("n_shared_experts") or 0))
    scale, norm = arg("routed_scaling_factor", 1.0), arg("norm_topk_prob")
    add_routing(w, True, scale, norm, arg("n_group"), arg("topk_group"))


def _bailing(w, arg, config: dict) -> None:
    """Ling 2.0: leading dense layers, shared experts (the width per shared expert), routing
    by the config's score function with the expert bias, grouped, scaled, renormalised as the
    config says."""

    sigmoid = arg("score_function", "softmax") == "sigmoid"
    w.add_leading_dense_block_count(int(arg("first_k_dense_replace", 0)))
    w.add_expert_shared_count(int(arg("num_shared_experts")))
    shared = arg("moe_shared_expert_intermediate_size") or arg("moe_intermediate_size")
    w.add_expert_shared_feed_forward_length(int(shared))
    scale, norm = arg("routed_scaling_factor", 1.0), arg("norm_topk_prob")
    add_routing(w, sigmoid, scale, norm, arg("n_group"), arg("topk_group"))


def _plamo3(w, arg, config: dict) -> None:
    """PLaMo 3's sliding layers beside every pattern-th full one, as mlx-lm runs them: a
    window of window_size + 1 over a whole sequence, a RoPE base of their own."""
    layers, period = int(arg("num_hidden_layers")), int(arg("sliding_window_pattern", 8))
    w.add_sliding_window(int(arg("sliding_window") or arg("window_size", 2048)) + 1)
    w.add_sliding_window_pattern([(i + 1) % period != 0 for i in range(layers)])
    w.add_rope_freq_base_swa(float(arg("rope_local_theta", 10000.0)))


def _exaone_moe(w, arg, config: dict) -> None:
    """K-EXAONE: sliding (roped) and full (unroped) layers per layer, leading dense layers,
    sigmoid routing with the correction bias, shared experts, scaled and renormalised."""

    types = list(arg("layer_types"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_leading_dense_block_count(list(arg("is_moe_layer")).index(True))
    shared = int(arg("num_shared_experts"))
    w.add_expert_shared_count(shared)
    w.add_expert_shared_feed_forward_length(shared * int(arg("moe_intermediate_size")))
    norm = bool(arg("norm_topk_prob")) and int(arg("num_experts_per_tok")) > 1
    scale = arg("routed_scaling_factor")
    add_routing(w, True, scale, norm, arg("n_group"), arg("topk_group"))


def _afmoe(w, arg, config: dict) -> None:
    """AFMoE (Arcee Trinity): sliding layers beside every 4th full one, leading dense layers,
    routing by the config's score function with the expert bias, shared experts."""

    types = list(arg("layer_types"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    w.add_leading_dense_block_count(int(arg("num_dense_layers", 0)))
    w.add_expert_shared_count(int(arg("num_shared_experts") or 0))
    sigmoid = arg("score_func", "sigmoid") == "sigmoid"
    scale, norm = arg("route_scale", 1.0), arg("route_norm", True)
    add_routing(w, sigmoid, scale, norm, arg("n_group"), arg("topk_group"))


def _llama4(w, arg, config: dict) -> None:
    """Llama 4: experts in every interleave_moe_layer_step-th layer beside a shared expert of
    their width, chunked attention and unroped layers as llama.cpp fixes them."""
    w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    w.add_interleave_moe_layer_step(int(arg("interleave_moe_layer_step")))


def _minimax(w, arg, config: dict) -> None:
    """MiniMax-M2: every layer's experts as wide as intermediate_size, sigmoid routing with the
    correction bias, renormalised."""

    w.add_expert_feed_forward_length(int(arg("intermediate_size")))
    add_routing(w, sigmoid=True)


def _minicpm(w, arg, config: dict) -> None:
    """muP-style scales: the embeddings, each residual branch, the logits."""
    w.add_embedding_scale(float(arg("scale_emb")))
    w.add_residual_scale(float(arg("scale_depth")) / config["num_hidden_layers"] ** 0.5)
    w.add_logit_scale(float(arg("hidden_size")) / float(arg("dim_model_base")))


def _granite(w, arg, config: dict) -> None:
    """The four Granite scales, every one written: some llama.cpp builds need all."""
    w.add_attention_scale(float(arg("attention_multiplier")))
    w.add_embedding_scale(float(arg("embedding_multiplier")))
    w.add_residual_scale(float(arg("residual_multiplier")))
    w.add_logit_scale(float(arg("logits_scaling")))


def _granite_hybrid(w, arg, config: dict) -> None:
    _granite(w, arg, config)
    add_granite_hybrid(w, arg)


def _cohere2(w, arg, config: dict) -> None:
    """Command R7B / A: sliding layers (roped) beside every pattern-th full one (unroped), a
    logit scale."""
    layers, period = config["num_hidden_layers"], int(arg("sliding_window_pattern"))
    w.add_sliding_window(int(arg("sliding_window")))
    w.add_sliding_window_pattern([(i + 1) % period != 0 for i in range(layers)])
    w.add_logit_scale(float(arg("logit_scale")))


def _mrope(w, arg, config: dict) -> None:
    """Qwen2-VL's multimodal RoPE sections (a text position is the same on every axis, so any
    split rotates alike)."""
    head_dim = head_counts(config)[2]
    scaling = arg("rope_scaling") or {}
    sections = list(scaling.get("mrope_section") or [head_dim // 2])
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


def _imrope(w, arg, config: dict) -> None:
    """Qwen3-VL's interleaved multimodal RoPE sections, as its converter writes them. llama.cpp
    leaves a text position's pairs past three times their section unrotated (its fourth
    position is 0): with Qwen3-VL's [24, 20, 20] of 64 pairs, the two slowest."""
    pairs = head_counts(config)[2] // 2
    scaling = arg("rope_scaling") or {}
    sections = list(
        scaling.get("mrope_section") or [(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3]
    )
    w.add_rope_dimension_sections((sections + [0, 0, 0, 0])[:4])


# model type -> the metadata it adds to the common keys
_EXTRA = {
    "gpt_neox": lambda w, arg, config: w.add_parallel_residual(
        bool(arg("use_parallel_residual", True))
    ),
    "qwen3_vl_text": _imrope,
    "qwen3_vl_moe_text": _imrope,
    "cohere": lambda w, arg, config: w.add_logit_scale(float(arg("logit_scale"))),
    "qwen2_vl_text": _mrope,
    "cohere2": _cohere2,
    "gemma2": _sliding,
    "gemma3_text": _sliding,
    "gpt_oss": _sliding,
    "olmo3": _sliding,
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
    "qwen3_next": _delta_net,
    "qwen3_5_text": _delta_net,
    "qwen3_5_moe_text": _delta_net,
    "glm4_moe": _glm4_moe,
    "solar_open": _glm4_moe,
    "minimax": _minimax,
    "llama4": _llama4,
    "afmoe": _afmoe,
    "exaone_moe": _exaone_moe,
    "plamo3": _plamo3,
    "bailing_moe": _bailing,
    "dots1": _dots1,
    "ernie4_5_moe": _ernie_moe,
    "exaone4": _exaone4,
    "minicpm": _minicpm,
    "granite": _granite,
    "granitemoe": _granite,
    "granitemoehybrid": _granite_hybrid,
}


# The families whose metadata is written whole (writers.py), by model type: from the built
# model's settings, or from the model itself (what its layers hold).
_WHOLE_FROM_ARGS = {
    "mamba2": add_mamba2,
    "mamba": add_mamba,
    "falcon_h1": add_falcon_h1,
    "mimo_v2_flash": add_mimo2,
    "minicpm3": add_minicpm3,
    "kimi_linear": add_kimi_linear,
    "nemotron_h": add_nemotron_h,
}
_WHOLE_FROM_MODEL = {"openelm": add_openelm, "step3p5": add_step35, "nemotron-nas": add_deci}


def add_hparams(w, config: dict, model=None):
    """The model's metadata as llama.cpp's loader for its architecture reads it."""
    mt, args = config["model_type"], model_args(model)
    arg = _reader(args, config)
    facts = FACTS.get(mt)
    if facts is not None and facts.write_settings is not None:
        return facts.write_settings(w, args)
    if mt in _WHOLE_FROM_ARGS:
        return _WHOLE_FROM_ARGS[mt](w, args)
    if mt in _WHOLE_FROM_MODEL:
        return _WHOLE_FROM_MODEL[mt](w, model)
    if FAMILIES[mt].arch in ("deepseek2", "mistral4"):
        return add_mla(w, args, mt)
    n_head, n_kv, head_dim = head_counts(config)
    layers = config["num_hidden_layers"]
    w.add_context_length(int(config.get("max_position_embeddings") or 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(float(arg("rms_norm_eps") or _rms_eps(arg, mt) or 1e-5))
    w.add_vocab_size(config["vocab_size"])
    if mt == "gemma4_text":
        return add_gemma4(w, args)
    w.add_feed_forward_length(_ffn_width(model, config))
    w.add_head_count_kv(_kv_heads(mt, arg, n_kv, layers))
    if FAMILIES[mt].arch not in UNROPED:
        _add_rope(w, arg, args, config, head_dim)
    if config.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    _add_experts(w, arg, mt)
    _layer_norm_eps(w, arg, mt)
    extra = _EXTRA.get(mt)
    if extra is not None:
        extra(w, arg, config)


# architectures with absolute positions (GPT-2's learned embeddings) or none (Mamba)
UNROPED = ("gpt2", "mamba")


def _rms_eps(arg, mt: str) -> float | None:
    """The RMSNorm epsilon of a family that names it otherwise (Qwen (1)'s
    layer_norm_epsilon)."""
    if mt in ("qwen", "exaone"):
        return arg("layer_norm_epsilon")
    return arg("norm_eps")


def _add_rope(w, arg, args, config: dict, head_dim: int) -> None:
    """The rotated share of each head and the RoPE base, as the model was built."""
    rotated = (
        arg("rotary_dim")
        or arg("rotary_pct")
        and head_dim * float(arg("rotary_pct"))  # GPT-NeoX's
        or head_dim * float(arg("partial_rotary_factor") or 1.0)
    )
    w.add_rope_dimension_count(int(rotated))
    theta = getattr(args, "rope_theta", None)  # as the model was built (config normalised)
    if theta is None and config["model_type"] == "qwen":
        theta = 10000.0  # mlx-lm's Qwen (1) rotates at MLX's default base, whatever the config
    if theta is None:
        theta = arg("rotary_emb_base")  # GPT-NeoX's
    theta = float(theta) if theta is not None else rope_base(config)
    alpha = _ntk_alpha(config)
    if alpha is not None:  # Hunyuan's NTK alpha: a larger base, as its converter writes it
        theta *= alpha ** (head_dim / (head_dim - 2))
    w.add_rope_freq_base(theta)


def _ntk_alpha(config: dict) -> float | None:
    """Hunyuan's dynamic NTK alpha (a RoPE base raised once, at load), or None."""
    sc = config.get("rope_scaling") or {}
    if config["model_type"] == "hunyuan_v1_dense" and "alpha" in sc:
        return float(sc["alpha"])
    return None


def add_rope_scaling(w, config: dict) -> np.ndarray | None:
    """The model's RoPE scaling as llama.cpp reads it: linear as metadata, Llama 3's as the
    ``rope_freqs`` tensor (returned, for a llama file); any other kind is refused by name."""
    import gguf

    sc = config.get("rope_scaling") or {}
    if config["model_type"] in ("ministral3", "mistral4"):  # RoPE settings in rope_parameters
        sc = config.get("rope_parameters") or sc
    kind = sc.get("rope_type") or sc.get("type") or "default"
    if kind == "default" or _ntk_alpha(config) is not None:  # alpha: in the base
        return None
    arch = FAMILIES[config["model_type"]].arch
    betas = (float(sc.get("beta_fast", 32.0)), float(sc.get("beta_slow", 1.0)))
    if kind in ("yarn", "deepseek_yarn") and arch != "mistral3" and betas != (32.0, 1.0):
        raise UserInputError(
            f"llama.cpp's {arch} reads no yarn betas (it keeps 32 and 1); this model's "
            f"beta_fast and beta_slow are {betas[0]:g} and {betas[1]:g}",
            "export --format gguf",
        )
    if (
        kind == "yarn"
        and arch == "mistral4"
        and (sc.get("mscale"), sc.get("mscale_all_dim")) != (1, 1)
    ):
        raise UserInputError(
            "llama.cpp's mistral4 runs yarn as mlx-lm's Mistral 4 only with mscale and "
            "mscale_all_dim both 1; this model's differ",
            "export --format gguf",
        )
    if kind in ("yarn", "deepseek_yarn") and arch in ("deepseek2", "mistral4"):
        if sc.get("mscale", 1.0) != sc.get("mscale_all_dim", 0.0):
            raise UserInputError(
                "llama.cpp's deepseek2 reads one yarn mscale (mscale_all_dim); this model's "
                "mscale and mscale_all_dim differ",
                "export --format gguf",
            )
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(0.1 * float(sc.get("mscale_all_dim", 0.0)))
        if arch == "mistral4" and sc.get("llama_4_scaling_beta") is not None:  # Llama 4's
            w.add_attn_temperature_scale(float(sc["llama_4_scaling_beta"]))
            w.add_attn_temperature_length(int(sc["original_max_position_embeddings"]))
        return None
    if kind == "yarn" and config["model_type"] == "ministral3":
        # Mistral's yarn: mscale_all_dim as the log multiplier, and Llama 4's position-wise
        # attention temperature (beta, over the original context)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        w.add_rope_scaling_yarn_log_mul(float(sc.get("mscale_all_dim", 0.0)))
        if sc.get("llama_4_scaling_beta") is not None:
            w.add_attn_temperature_scale(float(sc["llama_4_scaling_beta"]))
        return None
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(sc["factor"]))
        return None
    if kind == "yarn" and not {"mscale", "mscale_all_dim"} & set(sc):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(sc["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(sc["original_max_position_embeddings"]))
        w.add_rope_scaling_yarn_beta_fast(float(sc.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(sc.get("beta_slow", 1.0)))
        return None
    if kind == "llama3" and arch in LLAMA3_ROPE_ARCHS:
        return llama3_rope_factors(rope_base(config), head_counts(config)[2], sc)
    raise UserInputError(
        f"RoPE scaling {kind!r} of a {config['model_type']} model, as its config sets it, is "
        "not one llama.cpp reads from mlxtune's GGUF (linear, yarn without DeepSeek's mscale "
        "keys, and Llama 3's where llama.cpp's architecture reads rope_freqs)",
        "export --format gguf",
    )


def _ffn_width(model, config: dict) -> int:
    """The dense MLP's hidden width: LFM2 works its own out of block_ff_dim, so it is read off
    the weights there."""
    if config["model_type"] == "lfm2" and model is not None:
        for name, v in tree_flatten(model.parameters()):
            if name.endswith("feed_forward.w1.weight"):
                return int(v.shape[0])
    if config["model_type"] == "llama4":  # its dense layers' width (experts: intermediate_size)
        return int(config["intermediate_size_mlp"])
    if "intermediate_size" not in config and model is not None:  # GPT-2's: 4 x hidden
        mt, layers = config["model_type"], config["num_hidden_layers"]
        for name, v in tree_flatten(model.parameters()):
            if gguf_name(name, mt, layers) == "blk.0.ffn_up.weight":
                return int(v.shape[0])
    return int(config["intermediate_size"])
