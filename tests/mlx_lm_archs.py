"""Tiny random-weight architectures of every mlx-lm model type, for tests.

``ARCHS`` maps each model module of ``mlx_lm.models`` (mlx-lm 0.32.2, mlx 0.32.4) to a tiny
config.json-style dict (hidden size <= 64, 2 layers or the fewest a family's layer pattern
needs, 4 experts / top-2 for MoE, head dims 8-32).  Every entry builds with::

    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    logits = model(mx.array([[1, 2, 3, 4, 5, 6, 7, 8]]))  # [1, 8, vocab_size], finite

and was checked on CPU (forward finite, output shape right, also with vocab_size=96).
``cfg["model_type"]`` is the string ``_get_classes`` maps back to that very module.
Vision-language families carry only their text model, under ``text_config``.
Hybrids hold one layer of each kind (attention + recurrent/SSM/conv/linear), MoE families
at least one MoE layer.

``NOT_MODELS`` lists the modules that give no causal LM usable here, with the reason;
``EXTRA_ARCHS`` holds configs for those of them that build under conditions not met on a
CPU-only machine (Metal, ai2-olmo), for tests that can check for them.
``NOTES`` records, per model, what ``make_cache()`` returns ("KVCache(default)": no
``make_cache``, so mlx-lm makes one KVCache per layer), ``len(model.layers)``, the inner
module attribute, the output head and embedding paths, and whether the forward calls
``mlx_lm.models.base.scaled_dot_product_attention``.

Plain dicts only: importing this module imports nothing from mlx.
"""

from __future__ import annotations

import copy

NOT_MODELS: dict[str, str] = {
    "activations": "helper module (activation functions), no Model/ModelArgs",
    "base": "helper module (BaseModelArgs, masks, scaled_dot_product_attention)",
    "bitlinear_layers": "helper module (BitLinear layer used by bitnet)",
    "cache": "helper module (KVCache, RotatingKVCache, ArraysCache, ...)",
    "gated_delta": "helper module (gated delta-rule kernels for linear attention)",
    "mla": "helper module (multi-head latent attention pieces)",
    "pipeline": "helper module (PipelineMixin for pipeline parallelism)",
    "rope_utils": "helper module (initialize_rope and RoPE variants)",
    "ssm": "helper module (Mamba-2 state-space update kernels)",
    "switch_layers": "helper module (SwitchGLU / SwitchLinear for MoE experts)",
    "olmo": (
        "import runs sys.exit(1) (SystemExit: 1, prints 'To run olmo install ai2-olmo') "
        "unless hf_olmo is importable; with hf_olmo stubbed it builds, but a forward over "
        "more than one token fails: ValueError: Cannot perform inplace addition on an "
        "mlx.core.array and str (it adds the 'causal' mask string to the scores)"
    ),
    "bitnet": (
        "builds, but BitLinear's forward uses mx.fast.metal_kernel with no CPU path: "
        "RuntimeError: [metal_kernel] No Metal back-end."
    ),
    "muse_spark": (
        "builds, but its forward uses the mlx_lm.kernels Metal kernels (qk_norm_rope, "
        "norm_add_norm, expert_routing, ...) with no CPU path: RuntimeError: [metal_kernel] "
        "No Metal back-end."
    ),
    "phi3small": (
        "builds, but on CPU (mlx 0.32.4) its forward corrupts the heap: in about half the "
        "runs, even alone in a fresh process, the process dies (segfault, rc 139, or a glibc "
        "abort such as 'corrupted double-linked list' / 'double free or corruption (out)'), "
        "at once or at a later allocation; other runs pass. Config in EXTRA_ARCHS; run it "
        "only in a subprocess"
    ),
}

# The pieces most configs share, combined by ``_arch``.  Sizes: 64 wide, 2 layers, 4 query heads
# over 2 KV heads (``_SIZES`` leaves the KV head count to the family's default).
_SIZES = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
}
_DIMS = {**_SIZES, "num_key_value_heads": 2}
_ROPE = {"max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-06}
_DENSE = {**_DIMS, **_ROPE, "tie_word_embeddings": False}
_LLAMA = {**_DENSE, "head_dim": 16, "attention_bias": False, "mlp_bias": False}
_SLIDING = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
_WINDOWED = {**_DENSE, "head_dim": 16, **_SLIDING}
_GEMMA3 = {**_DIMS, "head_dim": 16, **_ROPE, "sliding_window": 4, "sliding_window_pattern": 2}
# Mixture of experts: top-2 routing over 4 experts of width 32; the expert count's key varies.
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_GROUPED = {"routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1}
_QWEN3_MOE = {
    **_DENSE,
    "head_dim": 16,
    "num_experts": 4,
    **_MOE,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}
_SHARED_EXPERT = {"n_routed_experts": 4, **_MOE, "n_shared_experts": 1, "first_k_dense_replace": 1}
_GLM4_MOE = {
    **_DENSE,
    "head_dim": 16,
    "attention_bias": False,
    **_SHARED_EXPERT,
    "norm_topk_prob": True,
    **_GROUPED,
}
# Multi-head latent attention (DeepSeek-V2 and the families built on it).
_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
_DEEPSEEK = {**_DIMS, **_ROPE, "attention_bias": False, **_SHARED_EXPERT, "moe_layer_freq": 1}
_DEEPSEEK_V3 = {**_DEEPSEEK, "norm_topk_prob": True, **_GROUPED, **_MLA}
_DSA_INDEXER = {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 4}
_YARN = {
    "rope_type": "yarn",
    "factor": 2.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_LOCAL_GLOBAL_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
# Gated-delta linear attention with a full-attention layer every second one (Qwen3-Next, 3.5).
_GATED_DELTA = {
    **_DENSE,
    "head_dim": 16,
    "attention_bias": False,
    "partial_rotary_factor": 0.5,
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_MROPE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    }
}
_BAILING = {
    **_DENSE,
    "num_experts": 4,
    **_MOE,
    "num_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    **_GROUPED,
    "partial_rotary_factor": 0.5,
    "use_bias": False,
    "use_qkv_bias": False,
    "use_qk_norm": True,
}
_GRANITE = {
    **_DENSE,
    "attention_bias": False,
    "logits_scaling": 4.0,
    "attention_multiplier": 0.0625,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
}
_LFM2_BASE = {
    **_DIMS,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "norm_eps": 1e-05,
    "conv_bias": False,
    "conv_L_cache": 3,
    "layer_types": ["conv", "full_attention"],
}
_LFM2 = {
    **_LFM2_BASE,
    "block_dim": 64,
    "block_ff_dim": 128,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True,
}
# Kimi linear attention: MLA with no query compression, every second layer KDA.
_KIMI_LINEAR = {
    **_DIMS,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "moe_layer_freq": 1,
    "linear_attn_config": {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "num_experts_per_token": 2,
}
_LONGCAT = {
    "vocab_size": 64,
    "hidden_size": 64,
    "num_attention_heads": 4,
    **_ROPE,
    "attention_bias": False,
    "n_routed_experts": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    **_MLA,
    "ffn_hidden_size": 128,
    "moe_topk": 2,
    "expert_ffn_hidden_size": 32,
    "zero_expert_num": 2,
    "num_layers": 1,
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
}
# Families that take their RoPE from ``rope_parameters``, with no ``rope_theta``.
_ROPE_PARAMETERS = {
    **_DIMS,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
}
_MINISTRAL3 = {
    **_ROPE_PARAMETERS,
    "rope_parameters": {**_YARN, "rope_theta": 1000000.0, "llama_4_scaling_beta": 0.1},
}


def _arch(model_type: str | None, *parts: dict) -> dict:
    """A config of ``model_type`` (none when None: a ``text_config`` its parent names) with each
    part's keys in turn, a later part's value replacing an earlier one's.  Nested values are
    copied, so no two configs share one."""
    cfg = {} if model_type is None else {"model_type": model_type}
    for part in parts:
        cfg.update(copy.deepcopy(part))
    return cfg


def _vl(model_type: str, text_config: dict, *parts: dict) -> dict:
    """A vision-language config that carries only its text model, under ``text_config``."""
    return {**_arch(model_type, *parts), "text_config": text_config}


ARCHS: dict[str, dict] = {
    "Klear": _arch(
        "Klear",
        _DIMS,
        _ROPE,
        _MOE,
        {
            "attention_bias": False,
            "num_experts": 4,
            "n_shared_experts": 1,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        },
    ),
    "afm7": _arch(
        "afm7",
        {
            "vocab_size": 64,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "hidden_dim": 64,
            "num_layers": 2,
            "num_kv_reuse_layers": 1,
            "num_heads": 4,
            "num_kv_heads": 2,
        },
    ),
    "afmoe": _arch(
        "afmoe",
        _WINDOWED,
        _MOE,
        {
            "num_experts": 4,
            "num_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "num_dense_layers": 1,
            "route_scale": 1.0,
        },
    ),
    "apertus": _arch(
        "apertus",
        _DENSE,
        {"attention_bias": False, "mlp_bias": False, "post_norm": False, "qk_norm": True},
    ),
    "baichuan_m1": _arch(
        "baichuan_m1",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "sliding_window": 4,
            "sliding_window_layers": [0],
            "conv_window": 2,
            "num_swa_attention_heads": 4,
            "num_swa_key_value_heads": 2,
        },
    ),
    "bailing_hybrid": _arch(
        "bailing_hybrid",
        _BAILING,
        _MLA,
        {"head_dim": 16, "layer_group_size": 2, "group_norm_size": 2},
    ),
    "bailing_moe": _arch("bailing_moe", _BAILING),
    "bailing_moe_linear": _arch(
        "bailing_moe_linear",
        _BAILING,
        {"head_dim": 16, "layer_group_size": 2, "group_norm_size": 2},
    ),
    "bailing_moe_v3": _arch(
        "bailing_moe_v3",
        _SIZES,
        _MLA,
        _ROPE,
        _GROUPED,
        _MOE,
        {
            "head_dim": 16,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_shared_experts": 1,
            "moe_shared_expert_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "layer_group_size": 2,
        },
    ),
    "cohere": _arch(
        "cohere",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "layer_norm_eps": 1e-05,
            "attention_bias": False,
            "use_qk_norm": True,
        },
    ),
    "cohere2": _arch(
        "cohere2",
        _DIMS,
        {
            "head_dim": 16,
            "rope_theta": 10000.0,
            "layer_norm_eps": 1e-05,
            "attention_bias": False,
            "sliding_window": 4,
            "sliding_window_pattern": 2,
        },
    ),
    "dbrx": _arch(
        "dbrx",
        {
            "vocab_size": 64,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        },
    ),
    "deepseek": _arch("deepseek", _DEEPSEEK),
    "deepseek_v2": _arch(
        "deepseek_v2", _DEEPSEEK, _MLA, _GROUPED, {"rope_scaling": {**_YARN, "type": "yarn"}}
    ),
    "deepseek_v3": _arch("deepseek_v3", _DEEPSEEK_V3),
    "deepseek_v32": _arch("deepseek_v32", _DEEPSEEK_V3, _DSA_INDEXER),
    "deepseek_v41": _arch(
        "deepseek_v41",
        _ROPE,
        _DSA_INDEXER,
        _MOE,
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "head_dim": 16,
            "n_routed_experts": 4,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "sliding_window": 4,
            "o_groups": 2,
            "o_lora_rank": 16,
            "hc_mult": 2,
        },
    ),
    "dots1": _arch("dots1", _GLM4_MOE, _LLAMA),
    "ernie4_5": _arch("ernie4_5", _DENSE, {"head_dim": 16, "use_bias": False}),
    "ernie4_5_moe": _arch(
        "ernie4_5_moe",
        _DENSE,
        {
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "use_bias": False,
            "moe_num_experts": 4,
            "moe_k": 2,
            "moe_layer_start_index": 1,
            "moe_num_shared_experts": 1,
        },
    ),
    "exaone": _arch(
        "exaone",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "layer_norm_epsilon": 1e-05,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "num_layers": 2,
        },
    ),
    "exaone4": _arch(
        "exaone4",
        _DENSE,
        {"head_dim": 16, "sliding_window": 4, "rope_scaling": None, "sliding_window_pattern": "LG"},
    ),
    "exaone_moe": _arch(
        "exaone_moe",
        _WINDOWED,
        _GROUPED,
        _MOE,
        {
            "num_experts": 4,
            "num_shared_experts": 1,
            "norm_topk_prob": True,
            "is_moe_layer": [False, True],
        },
    ),
    "falcon_h1": _arch(
        "falcon_h1",
        _LLAMA,
        {
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_chunk_size": 8,
            "mamba_d_conv": 4,
        },
    ),
    "gear": _arch("gear", _WINDOWED, {"attention_bias": False}),
    "gemma": _arch("gemma", _DIMS, {"head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-06}),
    "gemma2": _arch(
        "gemma2", _DIMS, {"head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-06}
    ),
    "gemma3": _vl("gemma3", _arch("gemma3_text", _GEMMA3), {"vocab_size": 64}),
    "gemma3_text": _arch("gemma3_text", _GEMMA3),
    "gemma3n": _vl(
        "gemma3n",
        _arch(
            "gemma3n_text",
            _DIMS,
            _ROPE,
            _SLIDING,
            {
                "intermediate_size": [128, 128],
                "head_dim": 16,
                "num_kv_shared_layers": 0,
                "vocab_size_per_layer_input": 64,
                "rope_local_base_freq": 10000.0,
                "final_logit_softcapping": 30.0,
                "activation_sparsity_pattern": [0.95, 0.0],
                "hidden_size_per_layer_input": 8,
                "altup_num_inputs": 4,
                "altup_coef_clip": 120.0,
                "altup_correct_scale": True,
                "altup_active_idx": 0,
                "laurel_rank": 8,
            },
        ),
    ),
    "gemma4": _vl(
        "gemma4",
        _arch(
            "gemma4_text",
            _DIMS,
            {
                "head_dim": 16,
                "max_position_embeddings": 512,
                "rms_norm_eps": 1e-06,
                "tie_word_embeddings": True,
                "num_experts": 4,
                "moe_intermediate_size": 32,
                "sliding_window": 4,
                "sliding_window_pattern": 2,
                "num_kv_shared_layers": 0,
                "global_head_dim": 32,
                "hidden_size_per_layer_input": 0,
                "enable_moe_block": True,
                "top_k_experts": 2,
                "attention_k_eq_v": True,
                "num_global_key_value_heads": 1,
            },
        ),
        {"vocab_size": 64},
    ),
    "gemma4_text": _arch(
        "gemma4_text",
        _DIMS,
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": True,
            "sliding_window": 4,
            "sliding_window_pattern": 2,
            "num_kv_shared_layers": 2,
            "global_head_dim": 32,
            "vocab_size_per_layer_input": 64,
            "hidden_size_per_layer_input": 8,
        },
    ),
    "glm": _arch("glm", _DENSE, {"head_dim": 16, "attention_bias": False}),
    "glm4": _arch(
        "glm4",
        _DIMS,
        _ROPE,
        {"head_dim": 16, "attention_bias": False, "partial_rotary_factor": 0.5},
    ),
    "glm4_moe": _arch(
        "glm4_moe",
        _GLM4_MOE,
        {"partial_rotary_factor": 0.5, "use_qk_norm": True, "rope_scaling": None},
    ),
    "glm4_moe_lite": _arch("glm4_moe_lite", _DEEPSEEK_V3, _DENSE),
    "glm_moe_dsa": _arch(
        "glm_moe_dsa",
        _DEEPSEEK_V3,
        _DSA_INDEXER,
        {
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    ),
    "gpt2": _arch(
        "gpt2",
        {
            "vocab_size": 64,
            "layer_norm_epsilon": 1e-05,
            "n_ctx": 256,
            "n_embd": 64,
            "n_head": 4,
            "n_layer": 2,
            "n_positions": 256,
        },
    ),
    "gpt_bigcode": _arch(
        "gpt_bigcode",
        {
            "vocab_size": 64,
            "layer_norm_epsilon": 1e-05,
            "tie_word_embeddings": False,
            "n_embd": 64,
            "n_layer": 2,
            "n_inner": 128,
            "n_head": 4,
            "n_positions": 256,
        },
    ),
    "gpt_neox": _arch(
        "gpt_neox",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 512,
            "layer_norm_eps": 1e-05,
            "rotary_emb_base": 10000,
            "rotary_pct": 0.25,
        },
    ),
    "gpt_oss": _arch(
        "gpt_oss",
        _DIMS,
        _SLIDING,
        {
            "head_dim": 16,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "gptj": _arch(
        "gptj",
        {
            "vocab_size": 64,
            "layer_norm_epsilon": 1e-05,
            "n_embd": 64,
            "n_head": 4,
            "n_layer": 2,
            "n_positions": 256,
            "rotary_dim": 8,
        },
    ),
    "granite": _arch("granite", _GRANITE, {"mlp_bias": False}),
    "granitemoe": _arch("granitemoe", _GRANITE, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "granitemoehybrid": _arch(
        "granitemoehybrid",
        _GRANITE,
        {
            "mlp_bias": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_proj_bias": False,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            "shared_intermediate_size": 64,
        },
    ),
    "helium": _arch("helium", _LLAMA),
    "hunyuan": _arch(
        "hunyuan",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "use_qk_norm": True,
            "moe_topk": 2,
            "num_shared_expert": 1,
            "use_mixed_mlp_moe": True,
            "use_cla": True,
            "cla_share_factor": 2,
            "rope_scaling": {
                "alpha": 1000.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "type": "dynamic",
            },
        },
    ),
    "hunyuan_v1_dense": _arch(
        "hunyuan_v1_dense", _DENSE, {"head_dim": 16, "attention_bias": False, "use_qk_norm": True}
    ),
    "internlm2": _arch("internlm2", _DENSE),
    "internlm3": _arch("internlm3", _DENSE),
    "iquestloopcoder": _arch("iquestloopcoder", _LLAMA),
    "jamba": _arch(
        "jamba",
        _DIMS,
        {
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "attn_layer_offset": 1,
            "attn_layer_period": 2,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "mamba_d_conv": 4,
            "mamba_d_state": 8,
            "mamba_expand": 2,
        },
    ),
    "kimi_k25": _vl("kimi_k25", _arch("kimi_k2", _DEEPSEEK_V3)),
    "kimi_k3": _vl(
        "kimi_k3", _arch("kimi_k3", _KIMI_LINEAR, _MLA, {"max_position_embeddings": 512})
    ),
    "kimi_linear": _arch(
        "kimi_linear",
        _KIMI_LINEAR,
        {"head_dim": 16, "rope_theta": 10000.0, "model_max_length": 512},
    ),
    "kimi_vl": _vl("kimi_vl", _arch("deepseek_v3", _DEEPSEEK_V3)),
    "laguna": _arch(
        "laguna",
        _ROPE_PARAMETERS,
        _SLIDING,
        _MOE,
        {
            "attention_bias": False,
            "num_experts": 4,
            "shared_expert_intermediate_size": 32,
            "partial_rotary_factor": 0.5,
            "mlp_layer_types": ["dense", "sparse"],
            "num_attention_heads_per_layer": [4, 4],
        },
    ),
    "lfm2": _arch("lfm2", _LFM2),
    "lfm2-vl": _vl("lfm2-vl", _arch("lfm2", _LFM2)),
    "lfm2_moe": _arch(
        "lfm2_moe",
        _LFM2_BASE,
        _MOE,
        {
            "num_experts": 4,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "use_expert_bias": True,
            "num_dense_layers": 1,
        },
    ),
    "lille-130m": _arch(
        "lille-130m",
        {
            "vocab_size": 64,
            "rope_theta": 10000.0,
            "layer_norm_eps": 1e-05,
            "tie_word_embeddings": False,
            "block_size": 256,
            "n_embd": 64,
            "n_head": 4,
            "n_kv_heads": 2,
            "n_layer": 2,
        },
    ),
    "llama": _arch("llama", _LLAMA),
    "llama4": _vl(
        "llama4",
        _arch(
            "llama4_text",
            _DIMS,
            _ROPE,
            {
                "num_hidden_layers": 4,
                "head_dim": 16,
                "attention_bias": False,
                "num_local_experts": 4,
                "num_experts_per_tok": 1,
                "use_qk_norm": True,
                "attention_chunk_size": 4,
                "interleave_moe_layer_step": 2,
                "intermediate_size_mlp": 128,
                "rope_scaling": None,
            },
        ),
    ),
    "llama4_text": _arch(
        "llama4_text",
        _DIMS,
        {
            "head_dim": 16,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "use_qk_norm": True,
            "intermediate_size_mlp": 128,
            "no_rope_layers": [1, 0],
        },
    ),
    "longcat_flash": _arch(
        "longcat_flash", _LONGCAT, {"attention_method": "MLA", "zero_expert_type": "identity"}
    ),
    "longcat_flash_ngram": _arch("longcat_flash_ngram", _LONGCAT, {"ngram_vocab_size_ratio": 2}),
    "mamba": _arch(
        "mamba",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "tie_word_embeddings": True,
            "use_bias": False,
            "state_size": 8,
            "conv_kernel": 4,
            "use_conv_bias": True,
            "time_step_rank": 8,
        },
    ),
    "mamba2": _arch(
        "mamba2",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "layer_norm_epsilon": 1e-05,
            "tie_word_embeddings": True,
            "use_bias": False,
            "num_heads": 8,
            "state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "use_conv_bias": True,
            "time_step_limit": [0.0, 100.0],
            "time_step_rank": 8,
        },
    ),
    "mellum": _arch(
        "mellum",
        _ROPE_PARAMETERS,
        _SLIDING,
        _MOE,
        {"num_experts": 4, "norm_topk_prob": True, "rope_parameters": _LOCAL_GLOBAL_ROPE},
    ),
    "mimo": _arch("mimo", _DENSE),
    "mimo_v2_flash": _arch(
        "mimo_v2_flash",
        _DIMS,
        _GROUPED,
        _MOE,
        {
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "v_head_dim": 16,
            "partial_rotary_factor": 0.5,
            "moe_layer_freq": [0, 1],
            "hybrid_layer_pattern": [0, 1],
            "add_swa_attention_sink_bias": True,
            "add_full_attention_sink_bias": False,
            "sliding_window_size": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "layernorm_epsilon": 1e-05,
            "swa_rope_theta": 10000.0,
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 16,
            "swa_v_head_dim": 16,
        },
    ),
    "minicpm": _arch(
        "minicpm", _DENSE, {"dim_model_base": 32, "scale_depth": 1.4, "scale_emb": 12}
    ),
    "minicpm3": _arch(
        "minicpm3",
        _DENSE,
        {
            "attention_bias": False,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "dim_model_base": 32,
            "scale_depth": 1.4,
            "scale_emb": 12,
            "rope_scaling": {
                "type": "longrope",
                "long_factor": [1.0, 1.5, 2.0, 3.0],
                "short_factor": [1.0, 1.0, 1.0, 1.0],
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "minimax": _arch(
        "minimax",
        _DENSE,
        {
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "use_qk_norm": True,
            "shared_intermediate_size": 0,
            "rotary_dim": 8,
        },
    ),
    "minimax_m3_vl": _vl(
        "minimax_m3_vl",
        _arch(
            "minimax_m3",
            _DIMS,
            _ROPE,
            {
                "intermediate_size": 32,
                "head_dim": 16,
                "tie_word_embeddings": False,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "routed_scaling_factor": 1.0,
                "partial_rotary_factor": 0.5,
                "use_qk_norm": True,
                "moe_layer_freq": [0, 1],
                "dense_intermediate_size": 128,
                "shared_intermediate_size": 32,
                "sparse_attention_config": {
                    "sparse_num_index_heads": 2,
                    "sparse_index_dim": 16,
                    "sparse_block_size": 4,
                    "sparse_topk_blocks": 1,
                    "sparse_local_block": 1,
                    "sparse_attention_freq": [0, 1],
                },
            },
        ),
    ),
    "ministral3": _arch("ministral3", _MINISTRAL3, _SLIDING),
    "mistral3": _vl("mistral3", _arch("ministral3", _MINISTRAL3)),
    "mistral4": _arch(
        "mistral4",
        _GLM4_MOE,
        _MLA,
        {"rope_parameters": {**_YARN, "rope_theta": 10000.0, "llama_4_scaling_beta": 0.1}},
    ),
    "mixtral": _arch(
        "mixtral",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "muse_glimmer": _arch("muse_glimmer", _WINDOWED),
    "nanbeige": _arch("nanbeige", _LLAMA),
    "nanochat": _arch("nanochat", _DIMS, {"max_position_embeddings": 512, "rope_theta": 10000.0}),
    "nemotron": _arch(
        "nemotron",
        _DIMS,
        {
            "head_dim": 16,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "norm_eps": 1e-05,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "partial_rotary_factor": 0.5,
            "hidden_act": "relu2",
        },
    ),
    "nemotron-nas": _arch(
        "nemotron-nas",
        _ROPE,
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "block_configs": [
                {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 2.0}},
                {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
                {"attention": {"replace_with_linear": True}, "ffn": {"replace_with_linear": True}},
            ],
        },
    ),
    "nemotron_h": _arch(
        "nemotron_h",
        _DIMS,
        _GROUPED,
        _MOE,
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "max_position_embeddings": 512,
            "layer_norm_epsilon": 1e-05,
            "attention_bias": False,
            "mlp_bias": False,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": 32,
            "norm_topk_prob": True,
            "use_bias": False,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "use_conv_bias": True,
            "hybrid_override_pattern": "M*E",
            "time_step_limit": [0.0, 100.0],
        },
    ),
    "olmo2": _arch("olmo2", _LLAMA),
    "olmo3": _arch("olmo3", _WINDOWED, {"attention_bias": False}),
    "olmo_hybrid": _arch(
        "olmo_hybrid",
        _DENSE,
        {
            "head_dim": 16,
            "layer_norm_epsilon": 1e-05,
            "attention_bias": False,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "linear_allow_neg_eigval": True,
            "layer_types": ["linear_attention", "full_attention"],
        },
    ),
    "olmoe": _arch(
        "olmoe", _LLAMA, {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}
    ),
    "openelm": _arch(
        "openelm",
        {
            "vocab_size": 64,
            "head_dim": 16,
            "rms_norm_eps": 1e-06,
            "num_transformer_layers": 2,
            "model_dim": 64,
            "ffn_dim_divisor": 16,
            "num_query_heads": [4, 4],
            "num_kv_heads": [2, 2],
            "ffn_multipliers": [1.0, 2.0],
        },
    ),
    "phi": _arch(
        "phi",
        _DIMS,
        {
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "layer_norm_eps": 1e-05,
            "partial_rotary_factor": 0.5,
        },
    ),
    "phi3": _arch("phi3", _DENSE, {"partial_rotary_factor": 0.5}),
    "phimoe": _arch("phimoe", _DIMS, _ROPE, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phixtral": _arch(
        "phixtral",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "num_vocab": 64,
            "model_dim": 64,
            "num_heads": 4,
            "num_layers": 2,
            "rotary_dim": 8,
        },
    ),
    "pixtral": _vl("pixtral", _arch("mistral", _LLAMA)),
    "plamo": _arch(
        "plamo", _SIZES, {"rope_theta": 10000.0, "rms_norm_eps": 1e-06, "n_shared_head": 2}
    ),
    "plamo2": _arch(
        "plamo2",
        _DIMS,
        {
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "hidden_size_per_head": 16,
            "attention_window_size": 4,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_num_heads": 8,
            "mamba_step": 2,
            "mamba_chunk_size": 8,
        },
    ),
    "plamo3": _arch("plamo3", _GEMMA3, _DENSE, {"window_size": 4, "rope_local_theta": 10000.0}),
    "prism_hadamard_qwen35": _vl(
        "prism_hadamard_qwen35",
        _arch("qwen3_5_text", _GATED_DELTA, _MROPE),
        {
            "schema_version": 2,
            "tensor_namespace": "mlx-vlm-qwen3_5",
            "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
            "modules": [
                {
                    "path": "model.layers.0.mlp.down_proj",
                    "embedding": False,
                    "dtype": "float16",
                    "block": 0,
                }
            ],
        },
    ),
    "qwen": _arch(
        "qwen",
        _SIZES,
        {
            "max_position_embeddings": 512,
            "layer_norm_epsilon": 1e-05,
            "kv_channels": 16,
            "no_bias": True,
        },
    ),
    "qwen2": _arch("qwen2", _DENSE),
    "qwen2_moe": _arch(
        "qwen2_moe",
        _DIMS,
        _MOE,
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "qwen2_vl": _vl("qwen2_vl", _arch("qwen2_vl_text", _DENSE)),
    "qwen3": _arch("qwen3", _DENSE, {"head_dim": 16}),
    "qwen3_5": _vl("qwen3_5", _arch("qwen3_5_text", _GATED_DELTA, _MROPE)),
    "qwen3_5_moe": _vl(
        "qwen3_5_moe",
        _arch(
            "qwen3_5_moe_text",
            _GATED_DELTA,
            _MOE,
            _MROPE,
            {
                "num_experts": 4,
                "shared_expert_intermediate_size": 32,
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,
            },
        ),
    ),
    "qwen3_moe": _arch("qwen3_moe", _QWEN3_MOE),
    "qwen3_next": _arch(
        "qwen3_next",
        _GATED_DELTA,
        _QWEN3_MOE,
        {"shared_expert_intermediate_size": 32, "linear_conv_kernel_dim": 4},
    ),
    "qwen3_vl": _vl("qwen3_vl", _arch("qwen3_vl_text", _DENSE, {"head_dim": 16})),
    "qwen3_vl_moe": _vl("qwen3_vl_moe", _arch("qwen3_vl_moe_text", _QWEN3_MOE)),
    "recurrent_gemma": _arch(
        "recurrent_gemma",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-06,
            "attention_bias": False,
            "conv1d_width": 4,
            "logits_soft_cap": 30.0,
            "attention_window_size": 4,
            "block_types": ["recurrent", "attention"],
        },
    ),
    "rwkv7": _arch(
        "rwkv7",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "head_dim": 16,
            "norm_eps": 1e-05,
            "tie_word_embeddings": False,
            "a_low_rank_dim": 8,
            "v_low_rank_dim": 8,
            "gate_low_rank_dim": 16,
            "decay_low_rank_dim": 8,
        },
    ),
    "seed_oss": _arch("seed_oss", _LLAMA),
    "smollm3": _arch("smollm3", _LLAMA, {"no_rope_layer_interval": 2}),
    "solar_open": _arch(
        "solar_open", _GLM4_MOE, {"partial_rotary_factor": 0.5, "use_qk_norm": True}
    ),
    "spark2_5": _arch(
        "spark2_5",
        _ROPE_PARAMETERS,
        _SLIDING,
        {"attention_bias": False, "mlp_bias": False, "rope_parameters": _LOCAL_GLOBAL_ROPE},
    ),
    "stablelm": _arch(
        "stablelm",
        _DIMS,
        {
            "rope_theta": 10000.0,
            "layer_norm_eps": 1e-05,
            "partial_rotary_factor": 0.25,
            "use_qkv_bias": True,
            "qk_layernorm": False,
        },
    ),
    "starcoder2": _arch("starcoder2", _DIMS, {"rope_theta": 10000.0, "tie_word_embeddings": False}),
    "step3p5": _arch(
        "step3p5",
        _SIZES,
        _ROPE,
        _SLIDING,
        {
            "head_dim": 16,
            "tie_word_embeddings": False,
            "moe_intermediate_size": 32,
            "num_attention_groups": 2,
            "moe_num_experts": 4,
            "moe_top_k": 2,
            "share_expert_dim": 32,
            "moe_layers_enum": "1",
        },
    ),
    "talkie": _arch("talkie", _SIZES, _ROPE, {"head_dim": 16}),
    "telechat3": _arch("telechat3", _LLAMA),
    "youtu_llm": _arch("youtu_llm", _DENSE, _MLA, {"attention_bias": False, "mlp_bias": False}),
}

EXTRA_ARCHS: dict[str, dict] = {
    "olmo": _arch(
        "olmo",
        {
            "vocab_size": 64,
            "rope_theta": 10000.0,
            "d_model": 64,
            "n_layers": 2,
            "mlp_hidden_size": 256,
            "n_heads": 4,
            "embedding_size": 64,
        },
    ),
    "bitnet": _arch("bitnet", _LLAMA),
    "muse_spark": _vl(
        "muse_spark",
        _arch(
            None,
            _SLIDING,
            _MOE,
            {
                "vocab_size": 64,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "rms_norm_eps": 1e-06,
                "num_local_experts": 4,
                "num_shared_experts": 0,
                "routed_scaling_factor": 1.0,
                "post_norm_eps": 1e-08,
                "rope_parameters": {"rope_theta": 10000.0},
                "layer_rope_theta": [10000.0, 0],
                "final_logit_softcapping": 20.0,
                "output_multiplier": 0.2,
                "moe_hidden_size": 32,
            },
        ),
    ),
    "phi3small": _arch(
        "phi3small",
        {
            "vocab_size": 64,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_norm_epsilon": 1e-05,
            "dense_attention_every_n_layers": 2,
            "ff_intermediate_size": 128,
            "gegelu_limit": 20.0,
        },
    ),
}

# How most models answer the questions NOTES records, and the tied head's and a
# vision-language wrapper's answers.
_TIED = "none(tied: embed.as_linear)"
_VL_NOTE = {
    "inner": "language_model",
    "head": "language_model.lm_head",
    "embed": "language_model.model.embed_tokens",
}
# A wrapper that has both: ``model`` and ``language_model``.
_VL_BOTH_NOTE = {**_VL_NOTE, "inner": "model,language_model"}


def _note(
    cache: str = "KVCache(default)",
    layers: int = 2,
    inner: str = "model",
    head: str = "lm_head",
    embed: str = "model.embed_tokens",
    sdpa: str = "yes",
) -> str:
    """One NOTES line; the defaults are a plain decoder's."""
    return (
        f"cache={cache}; layers={layers}; inner={inner}; head={head}; embed={embed}; "
        f"base.sdpa={sdpa}"
    )


NOTES: dict[str, str] = {
    "Klear": _note(),
    "afm7": _note(cache="KVCache", head=_TIED, embed="model.embedding"),
    "afmoe": _note(cache="KVCache+RotatingKVCache"),
    "apertus": _note(),
    "baichuan_m1": _note(
        cache="CacheList(ArraysCache,KVCache)+CacheList(ArraysCache,RotatingKVCache)"
    ),
    "bailing_hybrid": _note(cache="ArraysCache+KVCache", embed="model.word_embeddings"),
    "bailing_moe": _note(embed="model.word_embeddings"),
    "bailing_moe_linear": _note(cache="ArraysCache+KVCache", embed="model.word_embeddings"),
    "bailing_moe_v3": _note(cache="ArraysCache+KVCache", embed="model.word_embeddings"),
    "cohere": _note(head=_TIED),
    "cohere2": _note(cache="KVCache+RotatingKVCache", head=_TIED),
    "dbrx": _note(inner="transformer", embed="transformer.wte"),
    "deepseek": _note(),
    "deepseek_v2": _note(),
    "deepseek_v3": _note(),
    "deepseek_v32": _note(cache="CacheList(KVCache)"),
    "deepseek_v41": _note(cache="LayerCache", sdpa="no"),
    "dots1": _note(),
    "ernie4_5": _note(),
    "ernie4_5_moe": _note(),
    "exaone": _note(inner="transformer", embed="transformer.wte"),
    "exaone4": _note(cache="KVCache+RotatingKVCache"),
    "exaone_moe": _note(cache="KVCache+RotatingKVCache"),
    "falcon_h1": _note(cache="CacheList(ArraysCache,KVCache)"),
    "gear": _note(cache="KVCache+RotatingKVCache"),
    "gemma": _note(head=_TIED),
    "gemma2": _note(head=_TIED, sdpa="no"),
    "gemma3": _note(**_VL_NOTE, cache="KVCache+RotatingKVCache"),
    "gemma3_text": _note(cache="KVCache+RotatingKVCache"),
    "gemma3n": _note(
        cache="KVCache+RotatingKVCache",
        head=_TIED,
        embed="model.language_model.embed_tokens_per_layer,model.language_model.embed_tokens",
    ),
    "gemma4": _note(
        cache="KVCache+RotatingKVCache",
        inner="language_model",
        head=_TIED,
        embed="language_model.model.embed_tokens",
    ),
    "gemma4_text": _note(
        cache="KVCache+RotatingKVCache",
        layers=3,
        head=_TIED,
        embed="model.embed_tokens_per_layer,model.embed_tokens",
    ),
    "glm": _note(),
    "glm4": _note(),
    "glm4_moe": _note(),
    "glm4_moe_lite": _note(),
    "glm_moe_dsa": _note(cache="CacheList(KVCache)"),
    "gpt2": _note(head=_TIED, embed="model.wte"),
    "gpt_bigcode": _note(inner="transformer", embed="transformer.wte"),
    "gpt_neox": _note(head="model.embed_out", embed="model.embed_in"),
    "gpt_oss": _note(cache="KVCache+RotatingKVCache"),
    "gptj": _note(embed="model.wte"),
    "granite": _note(),
    "granitemoe": _note(),
    "granitemoehybrid": _note(cache="ArraysCache+KVCache"),
    "helium": _note(),
    "hunyuan": _note(head=_TIED),
    "hunyuan_v1_dense": _note(),
    "internlm2": _note(head="output", embed="model.tok_embeddings"),
    "internlm3": _note(),
    "iquestloopcoder": _note(cache="KVCache+RotatingKVCache"),
    "jamba": _note(cache="ArraysCache+KVCache"),
    "kimi_k25": _note(**_VL_BOTH_NOTE),
    "kimi_k3": _note(**_VL_BOTH_NOTE, cache="ArraysCache+KVCache"),
    "kimi_linear": _note(cache="ArraysCache+KVCache"),
    "kimi_vl": _note(**_VL_NOTE),
    "laguna": _note(cache="KVCache+RotatingKVCache"),
    "lfm2": _note(cache="ArraysCache+KVCache", head=_TIED),
    "lfm2-vl": _note(
        cache="ArraysCache+KVCache",
        inner="language_model",
        head=_TIED,
        embed="language_model.model.embed_tokens",
    ),
    "lfm2_moe": _note(cache="ArraysCache+KVCache", head=_TIED),
    "lille-130m": _note(inner="transformer", head=_TIED, embed="transformer.tok_embeddings"),
    "llama": _note(cache="KVCache"),
    "llama4": _note(**_VL_NOTE, cache="ChunkedKVCache+KVCache", layers=4),
    "llama4_text": _note(head="output"),
    "longcat_flash": _note(cache="CacheList(KVCache)", layers=1),
    "longcat_flash_ngram": _note(
        cache="ArraysCache+CacheList(KVCache)",
        layers=1,
        embed="model.ngram_embeddings.word_embeddings",
    ),
    "mamba": _note(
        cache="ArraysCache", inner="backbone", head=_TIED, embed="backbone.embeddings", sdpa="no"
    ),
    "mamba2": _note(
        cache="ArraysCache", inner="backbone", head=_TIED, embed="backbone.embeddings", sdpa="no"
    ),
    "mellum": _note(cache="KVCache+RotatingKVCache"),
    "mimo": _note(),
    "mimo_v2_flash": _note(cache="KVCache+RotatingKVCache"),
    "minicpm": _note(),
    "minicpm3": _note(),
    "minimax": _note(),
    "minimax_m3_vl": _note(**_VL_BOTH_NOTE, cache="CacheList(KVCache)"),
    "ministral3": _note(cache="KVCache+RotatingKVCache"),
    "mistral3": _note(**_VL_NOTE),
    "mistral4": _note(),
    "mixtral": _note(),
    "muse_glimmer": _note(cache="KVCache+RotatingKVCache"),
    "nanbeige": _note(cache="KVCache"),
    "nanochat": _note(inner="transformer", embed="transformer.wte"),
    "nemotron": _note(),
    "nemotron-nas": _note(cache="KVCache", layers=3),
    "nemotron_h": _note(
        cache="ArraysCache+KVCache", layers=3, inner="backbone", embed="backbone.embeddings"
    ),
    "olmo2": _note(),
    "olmo3": _note(cache="KVCache+RotatingKVCache"),
    "olmo_hybrid": _note(cache="ArraysCache+KVCache"),
    "olmoe": _note(),
    "openelm": _note(inner="transformer", head=_TIED, embed="transformer.token_embeddings"),
    "phi": _note(),
    "phi3": _note(),
    "phimoe": _note(),
    "phixtral": _note(inner="transformer", head="lm_head.linear", embed="transformer.embd.wte"),
    "pixtral": _note(**_VL_NOTE),
    "plamo": _note(),
    "plamo2": _note(cache="ArraysCache+KVCache", sdpa="no"),
    "plamo3": _note(cache="KVCache+RotatingKVCache"),
    "prism_hadamard_qwen35": _note(**_VL_BOTH_NOTE, cache="ArraysCache+KVCache"),
    "qwen": _note(inner="transformer", embed="transformer.wte"),
    "qwen2": _note(),
    "qwen2_moe": _note(),
    "qwen2_vl": _note(**_VL_NOTE),
    "qwen3": _note(),
    "qwen3_5": _note(**_VL_BOTH_NOTE, cache="ArraysCache+KVCache"),
    "qwen3_5_moe": _note(**_VL_BOTH_NOTE, cache="ArraysCache+KVCache"),
    "qwen3_moe": _note(),
    "qwen3_next": _note(cache="ArraysCache+KVCache"),
    "qwen3_vl": _note(**_VL_NOTE),
    "qwen3_vl_moe": _note(**_VL_NOTE),
    "recurrent_gemma": _note(cache="ArraysCache+RotatingKVCache"),
    "rwkv7": _note(cache="ArraysCache", embed="model.embeddings", sdpa="no"),
    "seed_oss": _note(),
    "smollm3": _note(),
    "solar_open": _note(),
    "spark2_5": _note(cache="KVCache+RotatingKVCache", embed="model.embedding"),
    "stablelm": _note(),
    "starcoder2": _note(),
    "step3p5": _note(cache="KVCache+RotatingKVCache"),
    "talkie": _note(head="none(no Linear head)", embed="model.embed"),
    "telechat3": _note(),
    "youtu_llm": _note(),
    "phi3small": _note(head=_TIED),
}

# Keys that hold a vocabulary size (at top level or in a nested text_config).
_VOCAB_KEYS = ("vocab_size", "num_vocab", "vocab_size_per_layer_input", "embedding_size")


def _set_vocab(cfg: dict, vocab_size: int) -> None:
    for key, value in cfg.items():
        if key in _VOCAB_KEYS:
            cfg[key] = vocab_size
        elif isinstance(value, dict):
            _set_vocab(value, vocab_size)


def tiny_config(name: str, vocab_size: int = 64) -> dict:
    """A deep copy of ``ARCHS[name]`` (or ``EXTRA_ARCHS[name]``) with every vocabulary-size
    key set to ``vocab_size``.  No config holds a token id, so nothing else depends on it."""
    if name in ARCHS:
        cfg = copy.deepcopy(ARCHS[name])
    elif name in EXTRA_ARCHS:
        cfg = copy.deepcopy(EXTRA_ARCHS[name])
    else:
        raise KeyError(f"no tiny config for mlx-lm model type {name!r}")
    _set_vocab(cfg, vocab_size)
    return cfg
