"""What llama.cpp's graphs fix per architecture instead of reading it, checked against a model
before its GGUF export: a model that does otherwise is refused by name (``refusal``), never
written to run differently."""

from __future__ import annotations

from types import SimpleNamespace

from ...gguf.families import FACTS
from ...gguf.names import FAMILIES
from .writers import nemotron_h_pattern, step35_layers


def model_args(model):
    """The ModelArgs a model was built with (``args``; Youtu's ``config``)."""
    args = getattr(model, "args", None)
    return args if args is not None else getattr(model, "config", None)


def exaone4_local(arg) -> list[bool] | None:
    """EXAONE 4's local ("L") layers, from its pattern string (None: every layer global)."""
    pattern = arg("sliding_window_pattern")
    if not pattern:
        return None
    return [pattern[i % len(pattern)] == "L" for i in range(int(arg("num_hidden_layers")))]


def _routing(arg, mt: str) -> str | None:
    family = FAMILIES[mt]
    if family.norm_topk is None:
        return None
    norm = arg("norm_topk_prob", True if mt in ("mixtral", "granitemoe") else None)
    if norm is not None and bool(norm) != family.norm_topk:
        return (
            f"llama.cpp's {family.arch} {'re' if family.norm_topk else 'does not re'}"
            f"normalise the routers' top-k weights; this model's norm_topk_prob is {norm}"
        )
    if arg("mlp_only_layers") or arg("decoder_sparse_step", 1) != 1:
        return f"llama.cpp's {family.arch} puts experts in every layer; this model does not"
    return None


def _unclamped(arg, mt: str) -> str | None:  # llama.cpp's SSM scans take the step as it is
    if float((arg("time_step_limit") or [0.0])[0]) > 0:
        return f"llama.cpp's {FAMILIES[mt].arch} does not clamp the SSM step from below; this model does"
    return None


def _gemma3(arg, mt: str) -> str | None:
    fixed = (
        ("sliding_window_pattern", 6),
        ("rope_local_base_freq", 10000.0),
        ("query_pre_attn_scalar", arg("head_dim")),
    )
    for key, value in fixed:
        if arg(key) is not None and float(arg(key)) != float(value):
            return f"llama.cpp's gemma3 fixes {key} at {value:g}; this model's is {arg(key):g}"
    return None


def _gemma4(arg, mt: str) -> str | None:
    full = (arg("rope_parameters") or {}).get("full_attention", {})
    if arg("enable_moe_block") or arg("attention_k_eq_v"):
        return "mlxtune writes Gemma 4's dense models to GGUF, not its experts or k = v form"
    if full.get("rope_type", "proportional") != "proportional":
        return "llama.cpp's gemma4 rotates full layers proportionally; this model does not"
    return None


def _smollm3(arg, mt: str) -> str | None:
    every4 = [int((i + 1) % 4 != 0) for i in range(arg("num_hidden_layers"))]
    layers = arg("no_rope_layers")
    if layers is not None and list(layers) != every4:
        return "llama.cpp's smollm3 leaves RoPE out of every 4th layer; this model does not"
    return None


def _olmoe(arg, mt: str) -> str | None:
    if (arg("num_key_value_heads") or arg("num_attention_heads")) != arg("num_attention_heads"):
        return (
            "llama.cpp's olmoe normalises keys over all heads at once, so it reads models with "
            "as many key/value heads as query heads; this model has fewer"
        )
    return None


def _ministral3(arg, mt: str) -> str | None:
    rp = arg("rope_parameters") or {}
    if arg("sliding_window") is not None:
        return (
            "llama.cpp's mistral3 attends over the whole context; this model's config sets a "
            "sliding_window"
        )
    if rp.get("mscale", rp.get("mscale_all_dim")) != rp.get("mscale_all_dim"):
        return "llama.cpp's mistral3 reads one yarn mscale; this model's two differ"
    return None


def _nemotron_h(arg, mt: str) -> str | None:
    if set(nemotron_h_pattern(arg("hybrid_override_pattern"))) - set("M*E"):
        return (
            "mlxtune writes Nemotron-H's mixture-of-experts form (Mamba, attention and expert "
            "layers); this model has dense MLP layers"
        )
    return _unclamped(arg, mt)


def _nemotron(arg, mt: str) -> str | None:
    if arg("hidden_act", "relu2") != "relu2":
        return (
            f"llama.cpp's nemotron squares a ReLU; this model's activation is {arg('hidden_act')}"
        )
    return None


def _gpt_oss(arg, mt: str) -> str | None:
    types = list(arg("layer_types") or [])
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(len(types))]
    if types != alternate:
        return (
            "llama.cpp's gpt-oss slides the window on even layers and attends fully on odd ones; "
            "this model's layer_types differ"
        )
    return None


def _short_conv(arg, mt: str) -> str | None:
    if int(arg("conv_L_cache", 0)) < 2:
        return "llama.cpp's lfm2 needs a short convolution of at least 2 taps"
    if mt == "lfm2_moe" and (
        float(arg("routed_scaling_factor", 1.0)) != 1.0 or not arg("use_expert_bias", True)
    ):
        return (
            "llama.cpp's lfm2moe mixes experts by their sigmoid weights with the expert bias, "
            "unscaled; this model scales them or has no expert bias"
        )
    return None


def _command_r(arg, mt: str) -> str | None:
    if bool(arg("use_qk_norm")) != (int(arg("num_hidden_layers")) >= 64):
        return (
            "llama.cpp's command-r holds q/k norms exactly when a model has 64 or more layers "
            f"(Command R+); this model has {arg('num_hidden_layers')} layers and "
            f"use_qk_norm {bool(arg('use_qk_norm'))}"
        )
    if arg("layer_norm_bias"):
        return "llama.cpp's command-r has LayerNorms without biases; this model's have biases"
    return None


def _rotate_half(arg, mt: str) -> str | None:
    if arg("rope_traditional"):
        return (
            f"mlxtune writes {mt} as llama.cpp's converter does, from rotate-half RoPE; this "
            "model's rope_traditional is set"
        )
    return None


def _minimax_m2(arg, mt: str) -> str | None:
    if not arg("use_qk_norm", True):
        return "llama.cpp's minimax-m2 normalises queries and keys; this model does not"
    return None


def _exaone4_layers(arg, mt: str) -> str | None:
    if exaone4_local(arg) is not None and int(arg("num_hidden_layers")) != 64:
        return (
            "llama.cpp's exaone4 reads local and global layers only in a model of 64 layers "
            "(EXAONE 4.0 32B) and otherwise ropes every layer over the whole context; this "
            f"model has {arg('num_hidden_layers')} layers and sliding_window_pattern "
            f"{arg('sliding_window_pattern')!r}"
        )
    return None


def _internlm2(arg, mt: str) -> str | None:
    if arg("bias"):
        return (
            "llama.cpp's internlm2 has no bias on the attention output; this model's bias is set "
            "(on q/k/v and the output)"
        )
    return None


def _mamba(arg, mt: str) -> str | None:
    if arg("use_bias"):
        return "llama.cpp's mamba has no bias on the in and out projections; this model has"
    if int(arg("intermediate_size")) != 2 * int(arg("hidden_size")):
        return (
            "llama.cpp's mamba reads an inner size of twice the hidden size; this model's differs"
        )
    if arg("use_bcdt_rms") and float(arg("mixer_rms_eps", 1e-6)) != 1e-5:
        return (
            "llama.cpp's mamba normalises dt, B and C with the model's one RMS epsilon (mlx-lm's "
            "1e-5 elsewhere); this model's mixer_rms_eps differs"
        )
    return None


def _qwen(arg, mt: str) -> str | None:
    if not arg("no_bias", True):
        return "llama.cpp's qwen has no bias on the attention output, MLP or head; this model has"
    return None


def _exaone(arg, mt: str) -> str | None:
    if arg("attention_bias") or arg("mlp_bias"):
        return (
            "llama.cpp's exaone has no bias on the attention output or the MLP; this model's "
            "attention_bias or mlp_bias is set"
        )
    return _rotate_half(arg, mt)


def _apertus(arg, mt: str) -> str | None:
    if arg("mlp_bias"):
        return "llama.cpp's apertus has no bias on the MLP; this model's mlp_bias is set"
    return _rotate_half(arg, mt)


def _openelm(arg, mt: str) -> str | None:
    for key, what in (
        ("normalize_qk_projections", "normalises queries and keys"),
        ("share_input_output_layers", "ties the head to the embedding"),
        ("ffn_with_glu", "gates its MLP"),
    ):
        if not arg(key, True):
            return f"llama.cpp's openelm {what}; this model's {key} is off"
    return None


def _deepseek_v2(arg, mt: str) -> str | None:
    if arg("topk_method") == "group_limited_greedy" and int(arg("n_group") or 1) > 1:
        return (
            "llama.cpp's deepseek2 ranks expert groups by their two best scores and mlx-lm's "
            "DeepSeek-V2 by the best one; this model routes by group (group_limited_greedy)"
        )
    if arg("n_routed_experts") and not arg("n_shared_experts"):
        return (
            "llama.cpp's deepseek2 reads shared experts beside the routed ones; this model has none"
        )
    if int(arg("moe_layer_freq", 1)) != 1:
        return "llama.cpp's deepseek2 puts experts in every layer after the dense ones; this model does not"
    if arg("attention_bias"):
        return "llama.cpp's deepseek2 has no attention biases; this model has"
    return None


def _youtu(arg, mt: str) -> str | None:
    if not arg("rope_traditional", True):
        return (
            "llama.cpp's deepseek2 rotates interleaved pairs; this model's rope_traditional is off"
        )
    if arg("attention_bias") or arg("mlp_bias"):
        return "llama.cpp's deepseek2 has no biases; this model has"
    return None


def _ernie4_5_moe(arg, mt: str) -> str | None:
    layers = int(arg("num_hidden_layers"))
    end = arg("moe_layer_end_index")
    if arg("moe_gate_act", "softmax") != "softmax":
        return "llama.cpp's ernie4_5-moe routes by softmax; this model's moe_gate_act differs"
    if int(arg("moe_layer_interval", 1)) != 1 or (end is not None and int(end) < layers - 1):
        return (
            "llama.cpp's ernie4_5-moe puts experts in every layer from moe_layer_start_index on; "
            "this model's moe_layer_interval or moe_layer_end_index says otherwise"
        )
    if arg("use_bias"):
        return (
            "llama.cpp's ernie4_5-moe has no bias on the attention output or MLPs; this model has"
        )
    return None


def _dots1_fixed(arg, mt: str) -> str | None:
    if (arg("num_key_value_heads") or arg("num_attention_heads")) != arg("num_attention_heads"):
        return (
            "llama.cpp's dots1 reads as many key/value heads as query heads; this model has fewer"
        )
    if arg("norm_topk_prob") and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's dots1 renormalises even one expert's weight and mlx-lm does not"
    if not arg("n_shared_experts"):
        return "llama.cpp's dots1 reads shared experts beside the routed ones; this model has none"
    if arg("mlp_bias"):
        return "llama.cpp's dots1 has no MLP biases; this model has"
    return None


def _bailing_fixed(arg, mt: str) -> str | None:
    if not arg("use_qk_norm"):
        return (
            "mlxtune writes Ling 2.0's layout (llama.cpp's bailingmoe2), which normalises "
            "queries and keys; this model does not (Ling 1's layout)"
        )
    if not (arg("num_shared_experts") and arg("moe_router_enable_shared_expert", True)):
        return "llama.cpp's bailingmoe2 reads shared experts beside the routed ones; this model has none"
    if arg("use_bias") or arg("use_qkv_bias"):
        return "llama.cpp's bailingmoe2 has no attention or MLP biases; this model has"
    if arg("norm_topk_prob") and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's bailingmoe2 renormalises even one expert's weight and mlx-lm does not"
    return None


def _falcon_h1(arg, mt: str) -> str | None:
    if arg("mamba_norm_before_gate"):
        return "llama.cpp's falcon-h1 gates before its SSM norm; this model norms before the gate"
    if arg("mamba_rms_norm") and int(arg("mamba_n_groups", 1)) > 1:
        return (
            "llama.cpp's falcon-h1 normalises the SSM output per group and mlx-lm's Falcon-H1 "
            "over the whole of it; this model has mamba_n_groups > 1"
        )
    for key in ("mamba_proj_bias", "projectors_bias", "attention_bias"):
        if arg(key):
            return f"llama.cpp's falcon-h1 applies no bias where {key} puts one; this model sets it"
    if arg("rope_traditional"):
        return _rotate_half(arg, mt)
    return None


def _plamo(arg, mt: str) -> str | None:
    if int(arg("num_attention_heads")) % int(arg("n_shared_head", 8)):
        return "mlx-lm's PLaMo shares kv heads evenly only when n_shared_head divides the heads"
    return _rotate_half(arg, mt)


def _exaone_moe_fixed(arg, mt: str) -> str | None:
    moe = [bool(x) for x in arg("is_moe_layer")]
    if "sliding_attention" not in list(arg("layer_types")):
        return (
            "llama.cpp's exaone-moe ropes only its sliding layers, and mlx-lm's ropes every layer "
            "of a model without one; this model has none"
        )
    if True not in moe or moe != [False] * moe.index(True) + [True] * (len(moe) - moe.index(True)):
        return (
            "llama.cpp's exaone-moe puts experts in every layer after the leading dense ones; "
            "this model's is_moe_layer does otherwise"
        )
    if not arg("num_shared_experts"):
        return "llama.cpp's exaone-moe reads shared experts beside the routed ones; this model has none"
    return None


def _mimo2(arg, mt: str) -> str | None:
    if arg("n_shared_experts"):
        return "llama.cpp's mimo2 has no shared experts; this model has"
    if int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's mimo2 renormalises even one expert's weight and mlx-lm does not"
    if float(arg("routed_scaling_factor") or 1.0) != 1.0:
        return "llama.cpp's mimo2 does not scale the routed experts' weights; this model does"
    if (arg("head_dim"), arg("v_head_dim")) != (arg("swa_head_dim"), arg("swa_v_head_dim")):
        return "llama.cpp's mimo2 reads one head size for every layer; this model's differ"
    return None


def _mistral4(arg, mt: str) -> str | None:
    layers, vocab = int(arg("num_hidden_layers")), int(arg("vocab_size"))
    if arg("rope_interleave") is False:
        return "llama.cpp's mistral4 rotates interleaved pairs; this model's rope_interleave is off"
    if arg("q_lora_rank") and (layers in (26, 27) or (layers == 48 and vocab == 128256)):
        return (
            "llama.cpp's deepseek2 loader reads no q_lora_rank at this layer count (DeepSeek-V2 "
            "Lite's); this model has one"
        )
    if float(arg("rms_norm_eps")) != 1e-6:
        return (
            "mlx-lm's Mistral 4 normalises its latent q and kv at an epsilon of 1e-6 and "
            "llama.cpp at rms_norm_eps; this model's differs"
        )
    if not arg("n_shared_experts"):
        return (
            "llama.cpp's mistral4 reads shared experts beside the routed ones; this model has none"
        )
    if arg("attention_bias"):
        return "llama.cpp's mistral4 has no attention biases; this model has"
    return None


def _afmoe_fixed(arg, mt: str) -> str | None:
    types = list(arg("layer_types"))
    every4 = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(len(types))]
    if types != every4:
        return (
            "llama.cpp's afmoe ropes and slides every layer but every 4th; this model's "
            "layer_types differ"
        )
    if not arg("mup_enabled", True):
        return "llama.cpp's afmoe scales the embeddings by sqrt(hidden); this model does not"
    if arg("route_norm", True) and int(arg("num_experts_per_tok")) == 1:
        return "llama.cpp's afmoe renormalises even one expert's weight and mlx-lm does not"
    return None


def _step35(arg, mt: str) -> str | None:
    fields = (
        "num_hidden_layers", "layer_types", "attention_other_setting", "partial_rotary_factors",
        "rope_theta", "head_dim", "num_attention_heads", "num_attention_groups",
    )  # fmt: skip
    layers = step35_layers(SimpleNamespace(**{k: arg(k) for k in fields}))
    for kind in (True, False):
        same = {(x[3], x[4]) for x in layers if x[0] == kind}
        if len(same) > 1:
            return (
                "llama.cpp's step35 reads one rotated share and RoPE base per layer type; this "
                "model's differ between layers of one type"
            )
    if arg("rope_scaling"):
        return "mlxtune writes Step 3.5 without RoPE scaling; this model's config sets one"
    if not float(arg("moe_router_scaling_factor", 3.0)):
        return "llama.cpp's step35 reads a routed scale of 0 as none; this model's is 0"
    return None


def _llama4_fixed(arg, mt: str) -> str | None:
    experts = int(arg("num_local_experts"))
    if int(arg("attention_chunk_size")) != 8192:
        return "llama.cpp's llama4 chunks attention by 8192 tokens; this model's chunk differs"
    if bool(arg("use_qk_norm")) != (experts != 128):
        return (
            "llama.cpp's llama4 normalises queries and keys exactly when a model has other than "
            f"128 experts; this model has {experts} and use_qk_norm {bool(arg('use_qk_norm'))}"
        )
    tuning = (
        bool(arg("attn_temperature_tuning", 4)),
        arg("floor_scale", 8192),
        arg("attn_scale", 0.1),
    )
    if tuning != (True, 8192, 0.1):
        return (
            "llama.cpp's llama4 tunes the unroped layers' attention temperature with a floor of "
            "8192 and a scale of 0.1; this model's differ"
        )
    if arg("attention_bias"):
        return "llama.cpp's llama4 has no bias on the attention output; this model has"
    return None


def _minicpm3(arg, mt: str) -> str | None:
    if arg("attention_bias"):
        return "llama.cpp's minicpm3 has no attention biases; this model has"
    if arg("rope_traditional"):
        return _rotate_half(arg, mt)
    return None


def _kimi_linear(arg, mt: str) -> str | None:
    la = arg("linear_attn_config") or {}
    if int(la.get("num_heads", 0)) != int(arg("num_attention_heads")):
        return "llama.cpp's kimi-linear reads one head count for both kinds of layer; this model's differ"
    if float(arg("rms_norm_eps")) != 1e-6:
        return (
            "mlx-lm's Kimi Linear normalises its delta-net's q and k at an epsilon of 1e-6 and "
            "llama.cpp at rms_norm_eps; this model's differs"
        )
    if not arg("moe_renormalize", True) or int(arg("num_experts_per_token", 1)) == 1:
        return "llama.cpp's kimi-linear renormalises the top-k weights, even one's; this model does not"
    if int(arg("moe_layer_freq", 1)) != 1:
        return "llama.cpp's kimi-linear puts experts in every layer after the dense ones; this model does not"
    if not arg("num_shared_experts"):
        return (
            "llama.cpp's kimi-linear adds a shared expert in every MoE layer; this model has none"
        )
    if not arg("qk_rope_head_dim"):
        return "llama.cpp's kimi-linear keeps a rotary part in its latent keys; this model has none"
    return None


def _deci(arg, mt: str) -> str | None:
    if arg("hidden_act", "silu") != "silu":
        return f"llama.cpp's deci gates its MLP with SiLU; this model's activation is {arg('hidden_act')}"
    for i, block in enumerate(arg("block_configs") or []):
        ffn = block.ffn if hasattr(block, "ffn") else None
        attn = block.attention if hasattr(block, "attention") else None
        if ffn is not None and ffn.replace_with_linear:
            return f"llama.cpp's deci has no linear MLP; layer {i} of this model has one"
        if attn is not None and attn.replace_with_linear and arg("attention_bias"):
            return (
                "llama.cpp's deci applies no bias in a linear attention; this model's "
                f"layer {i} has one"
            )
    return None


# model type -> what llama.cpp fixes for its architecture, checked against the model
_FIXED = {
    "nemotron-nas": _deci,
    "kimi_linear": _kimi_linear,
    "minicpm3": _minicpm3,
    "llama4": _llama4_fixed,
    "step3p5": _step35,
    "afmoe": _afmoe_fixed,
    "mistral4": _mistral4,
    "mimo_v2_flash": _mimo2,
    "exaone_moe": _exaone_moe_fixed,
    "plamo": _plamo,
    "falcon_h1": _falcon_h1,
    "bailing_moe": _bailing_fixed,
    "dots1": _dots1_fixed,
    "ernie4_5_moe": _ernie4_5_moe,
    "deepseek_v2": _deepseek_v2,
    "youtu_llm": _youtu,
    "openelm": _openelm,
    "apertus": _apertus,
    "exaone": _exaone,
    "qwen": _qwen,
    "mamba": _mamba,
    "internlm2": _internlm2,
    "exaone4": _exaone4_layers,
    "minimax": _minimax_m2,
    "internlm3": _rotate_half,
    "cohere": _command_r,
    "gemma3_text": _gemma3,
    "gemma4_text": _gemma4,
    "smollm3": _smollm3,
    "olmoe": _olmoe,
    "ministral3": _ministral3,
    "nemotron_h": _nemotron_h,
    "nemotron": _nemotron,
    "mamba2": _unclamped,
    "granitemoehybrid": _unclamped,
    "gpt_oss": _gpt_oss,
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
}
_FIXED.update({mt: f.refusal for mt, f in FACTS.items() if f.refusal is not None})


def refusal(model, config: dict) -> str | None:
    """What llama.cpp fixes for the architecture that this model does otherwise (None: none).
    llama.cpp's graphs hard-code some settings per architecture instead of reading them."""
    mt, args = config["model_type"], model_args(model)

    def arg(name, default=None):
        return getattr(args, name, config.get(name, default))

    check = _FIXED.get(mt)
    return _routing(arg, mt) or (check(arg, mt) if check else None)
