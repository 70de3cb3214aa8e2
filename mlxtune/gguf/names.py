"""GGUF's names for the families and tensors mlxtune exports and reads back: one table, so the
export (export.py) and the import (load.py) agree.

Tensor names come from the ``gguf`` package's ``TensorNameMap`` (llama.cpp's converter's own
table, limited to the tensors each architecture has), so a tensor llama.cpp's architecture does
not hold has no name and the export refuses it by name. A mixture's experts are held stacked
(mlx-lm's ``switch_mlp``), which is llama.cpp's layout too (``ffn_*_exps``).
"""

from __future__ import annotations

from functools import lru_cache

from .families import FACTS
from .family import Family

FAMILIES = {
    "llama": Family("llama", permuted=True),
    "mistral": Family("llama", permuted=True),
    "mixtral": Family("llama", permuted=True, norm_topk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "qwen2_moe": Family("qwen2moe", norm_topk=False),
    "qwen3_moe": Family("qwen3moe", norm_topk=True),
    "olmoe": Family("olmoe", norm_topk=False),
    "olmo2": Family("olmo2"),
    "granite": Family("granite", permuted=True),
    "granitemoe": Family("granitemoe", permuted=True, norm_topk=True),
    "smollm3": Family("smollm3", permuted=True),
    "gemma": Family("gemma", norm_plus_one=True),
    "gemma2": Family("gemma2", norm_plus_one=True),
    "gemma3_text": Family("gemma3", norm_plus_one=True),
    "phi3": Family("phi3"),
    "lfm2": Family("lfm2"),
    "gpt_oss": Family("gpt-oss", norm_topk=True),
    "lfm2_moe": Family("lfm2moe", norm_topk=True),
    "glm4_moe": Family("glm4moe", norm_topk=True),
    "glm4": Family("glm4"),
    "ernie4_5": Family("ernie4_5"),
    "seed_oss": Family("seed_oss"),
    "gemma4_text": Family("gemma4"),
    "qwen3_next": Family("qwen3next", norm_topk=True),
    "qwen3_5_text": Family("qwen35"),
    "qwen3_5_moe_text": Family("qwen35moe", norm_topk=True),
    "mamba2": Family("mamba2"),
    "stablelm": Family("stablelm"),
    "starcoder2": Family("starcoder2"),
    "minicpm": Family("minicpm", permuted=True),
    "deepseek": Family("deepseek", permuted=True, norm_topk=False),
    "nemotron": Family("nemotron", norm_plus_one=True),  # LayerNorm1P: (1 + w)
    "ministral3": Family("mistral3", permuted=True),
    "deepseek_v3": Family("deepseek2"),
    "glm4_moe_lite": Family("deepseek2"),
    "kimi_k2": Family("deepseek2"),  # Kimi K2 / K2.5's language model: mlx-lm's deepseek_v3
    "olmo3": Family("olmo2"),
    "nemotron_h": Family("nemotron_h_moe", norm_topk=True),
    "granitemoehybrid": Family("granitehybrid", permuted=True, norm_topk=True),
    "cohere2": Family("cohere2"),
    "qwen2_vl_text": Family("qwen2vl"),
    "qwen3_vl_text": Family("qwen3vl"),
    "qwen3_vl_moe_text": Family("qwen3vlmoe", norm_topk=True),
    "solar_open": Family("glm4moe", norm_topk=True),  # mlx-lm's glm4_moe model; so the converter
    "phi": Family("phi2"),
    "gpt2": Family("gpt2"),
    "nemotron-nas": Family("deci"),  # q/k rows permuted per layer (its kv heads differ)
    "kimi_linear": Family("kimi-linear"),
    "minicpm3": Family("minicpm3"),
    "llama4": Family("llama4"),  # Llama 4's language model (mlx-lm's llama4 wrapper)
    "step3p5": Family("step35"),
    "afmoe": Family("afmoe"),
    "mistral4": Family("mistral4"),
    "mimo_v2_flash": Family("mimo2", norm_topk=True),
    "exaone_moe": Family("exaone-moe", norm_topk=None),
    "plamo": Family("plamo"),
    "plamo3": Family("plamo3"),
    "falcon_h1": Family("falcon-h1"),
    "bailing_moe": Family("bailingmoe2", norm_topk=None),  # Ling 2.0's layout
    "dots1": Family("dots1", norm_topk=None),
    "ernie4_5_moe": Family("ernie4_5-moe", norm_topk=True),
    "deepseek_v2": Family("deepseek2"),
    "youtu_llm": Family("deepseek2"),
    "openelm": Family("openelm"),
    "apertus": Family("apertus"),
    "exaone": Family("exaone"),
    "qwen": Family("qwen"),
    "mamba": Family("mamba"),
    "gpt_neox": Family("gptneox"),
    "internlm2": Family("internlm2", permuted=True),
    "exaone4": Family("exaone4"),
    "minimax": Family("minimax-m2", norm_topk=True),
    "internlm3": Family("llama", permuted=True),  # as llama.cpp's converter writes InternLM 3
    "cohere": Family("command-r"),
    "hunyuan_v1_dense": Family("hunyuan-dense"),
}
# the families kept in a module of their own (mlxtune.gguf.families)
FAMILIES.update({mt: f.names for mt, f in FACTS.items()})
# a fused q/k/v projection's rows, per model type (llama.cpp's converter splits each into
# attn_q/k/v): "contiguous" all q rows, then k, then v; "per_head" q, k, v of each head in
# turn (GPT-NeoX); "grouped" each kv head's q rows, then its k and v (InternLM 2)
QKV_LAYOUT = {"internlm2": "grouped", "gpt_neox": "per_head"}
# tensors an architecture's llama.cpp graph multiplies by without applying LoRA adapters (a
# GGUF adapter there would be ignored): multi-head latent attention's projections
NO_ADAPTER = {
    "deepseek2": ("attn_q_a", "attn_q_b", "attn_q", "attn_kv_a_mqa", "attn_kv_b", "output"),
    "minicpm3": ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_kv_b"),
    # Kimi Linear: its delta-net's projections and the latent attention's (the delta-net
    # layers' output too: attn_output is refused in every layer, MLA's honours adapters)
    "kimi-linear": (
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ssm_f_a",
        "ssm_f_b",
        "ssm_beta",
        "ssm_g_a",
        "ssm_g_b",
        "attn_kv_a_mqa",
        "output",
    ),  # fmt: skip
    "mistral4": ("attn_q_a", "attn_q_b", "attn_q", "attn_kv_a_mqa", "attn_kv_b", "output"),
}
# Apertus's xIELU parameters: metadata arrays in llama.cpp (one value per layer), held here
# under these names between the model and the file
XIELU = ("alpha_p", "alpha_n", "beta", "eps")
_FUSED_QKV = ("wqkv", "query_key_value", "c_attn", "qkv_proj", "Wqkv")
# Granite's shared MLP holds gate and up in one matrix; llama.cpp holds two (split on export)
SHARED_GATE_UP = "ffn_gate_up_shexp"
# model types llama.cpp names an architecture for but would run otherwise than mlx-lm (or
# not at all), with the reason: the GGUF export refuses them by name
RUNS_OTHERWISE = {
    "gptj": "llama.cpp lists 'gptj' but has no model for it (its loader refuses the architecture)",
    "phimoe": (
        "llama.cpp's phimoe weighs the top-k experts by their softmax, renormalised, where "
        "mlx-lm's PhiMoE uses sparsemixer routing (each chosen expert's weight near 1), and "
        "normalises by RMS where mlx-lm's uses LayerNorm"
    ),
    "jamba": (
        "llama.cpp's jamba weighs the top-k experts by their softmax over all experts, not "
        "renormalised; mlx-lm's Jamba renormalises them"
    ),
    "hunyuan": (
        "llama.cpp's hunyuan-moe renormalises the top-k experts' weights, which mlx-lm's Hunyuan "
        "does not, and shares no keys and values across layers as Hunyuan's CLA does"
    ),
    "bitnet": (
        "llama.cpp's bitnet gates its MLP with SiLU where BitNet (mlx-lm's, as transformers') "
        "squares a ReLU"
    ),
    "gemma3n_text": (
        "llama.cpp's gemma3n cuts its sparse MLP activations at the mean plus a multiple of the "
        "sample standard deviation, mlx-lm's Gemma 3n at the population one"
    ),
    "gemma3n": (  # the multimodal wrapper (its language model: gemma3n_text)
        "llama.cpp's gemma3n cuts its sparse MLP activations at the mean plus a multiple of the "
        "sample standard deviation, mlx-lm's Gemma 3n at the population one"
    ),
    "glm_moe_dsa": (
        "llama.cpp's glm-dsa normalises its sparse-attention indexer's keys with an epsilon of "
        "0 (it reads none), mlx-lm's GLM-5 at 1e-5"
    ),
    "plamo2": (
        "mlx-lm's PLaMo 2 clamps the SSM step to [0.001, 100] and llama.cpp's plamo2 does not "
        "clamp it"
    ),
    "rwkv7": (
        "llama.cpp's rwkv7 in llama-cpp-python 0.3.36 gives two evaluations of the same tokens "
        "different logits on this machine, so no export of it can be checked against mlx-lm"
    ),
    "llama4_text": (
        "llama.cpp's llama4 is Llama 4's mixture of experts; mlx-lm's llama4_text is a dense "
        "model whose unroped layers and query/key norms llama.cpp would place otherwise"
    ),
}
# mlx-lm model types whose llama.cpp architecture is spelled otherwise
_ARCH_ALIASES = {
    "hunyuan": "hunyuan-moe",
    "step3p5": "step35",
    "mimo_v2_flash": "mimo2",
    "glm_moe_dsa": "glm-dsa",
    "nemotron-nas": "deci",
}
# a joined gate-then-up matrix -> the two tensors llama.cpp's converter splits it into
# (Granite's shared MLP; OpenELM's proj_1)
GATE_UP = {
    SHARED_GATE_UP: ("ffn_gate_shexp", "ffn_up_shexp"),
    "ffn_gate_up": ("ffn_gate", "ffn_up"),
}
# multi-head latent attention's per-head factors (mlx-lm's split of kv_b_proj) -> llama.cpp's
_MLA = {"embed_q": "ATTN_K_B", "unembed_out": "ATTN_V_B"}
# a bare parameter's suffix in llama.cpp (the converter's): the rest are weights
_BARE = {
    "exp_probs_b": ".bias",
    "ssm_a": "",
    "ssm_d": "",
    "ffn_norm": "",  # Falcon-H1's
    "post_attention_norm": "",  # PLaMo 3's
    "post_ffw_norm": "",
}
# an RMSNorm whose scale is weight + offset, per architecture and GGUF tensor (stored as
# weight + offset, as llama.cpp's converter does)
NORM_OFFSETS = {
    "plamo3": {
        "attn_norm": 1.0,
        "post_attention_norm": 0.2,
        "ffn_norm": 1.0,
        "post_ffw_norm": 5**-1.5,
        "output_norm": 1.0,
        "attn_q_norm": 1.0,
        "attn_k_norm": 1.0,
    },
}
# model_type -> (gguf architecture, whether q/k rows are permuted as llama.cpp's converter does)
ARCHES = {mt: (f.arch, f.permuted) for mt, f in FAMILIES.items()}
NORM_PLUS_ONE = tuple(mt for mt, f in FAMILIES.items() if f.norm_plus_one)
DTYPES = ("f32", "f16", "bf16", "q8_0")

# a stacked expert projection (mlx-lm's switch_mlp) -> llama.cpp's merged expert tensor
_EXPERTS = {
    "gate_proj": "FFN_GATE_EXP",
    "up_proj": "FFN_UP_EXP",
    "down_proj": "FFN_DOWN_EXP",
    "fc1": "FFN_UP_EXP",
    "fc2": "FFN_DOWN_EXP",
    "w1": "FFN_GATE_EXP",  # DBRX's (and Mixtral's published) names
    "v1": "FFN_UP_EXP",
    "w3": "FFN_UP_EXP",
    "w2": "FFN_DOWN_EXP",
}


def llama_cpp_arch(model_type: str) -> str | None:
    """The llama.cpp architecture of the same name as an mlx-lm model type (spelling aside:
    ``gpt_oss`` is ``gpt-oss``, ``qwen3_next`` ``qwen3next``), or None."""
    import gguf

    if model_type in FAMILIES:
        return FAMILIES[model_type].arch
    if model_type in _ARCH_ALIASES:
        return _ARCH_ALIASES[model_type]

    def key(name: str) -> str:
        return name.removesuffix("_text").replace("_", "").replace("-", "")

    return next((a for a in gguf.MODEL_ARCH_NAMES.values() if key(a) == key(model_type)), None)


def separate_qkv(arch: str) -> bool:
    """Whether llama.cpp's converter writes the architecture's q/k/v as three tensors (else as
    one, all q rows first), by the tensors gguf lists for it."""
    import gguf

    return gguf.MODEL_TENSOR.ATTN_Q in gguf.MODEL_TENSORS[_arch_code(arch)]


def _arch_code(arch: str):
    import gguf

    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)


@lru_cache(maxsize=16)
def _name_map(arch: str, n_blocks: int):
    import gguf

    return gguf.get_tensor_name_map(_arch_code(arch), n_blocks)


# mlx-lm's names -> the published checkpoint's, where llama.cpp's name map knows only those
_RENAMES = {
    "nemotron-nas": ((".self_attn.linear.", ".self_attn.linear_attn."),),
    "kimi_linear": (
        (".q_conv.conv.", ".q_conv1d."),
        (".k_conv.conv.", ".k_conv1d."),
        (".v_conv.conv.", ".v_conv1d."),
    ),
    "step3p5": (
        (".mlp.gate.gate.", ".moe.gate."),
        (".mlp.gate.router_bias", ".moe.router_bias"),
        (".mlp.share_expert.", ".share_expert."),
    ),
}


def _renamed(hf: str, model_type: str) -> list[str]:
    out = hf
    for old, new in _RENAMES.get(model_type, ()):
        out = out.replace(old, new)
    return [out] if out != hf else []


def gguf_name(hf: str, model_type: str = "llama", n_blocks: int = 1) -> str | None:
    """The GGUF tensor name for a Hugging Face/mlx-lm parameter name of a model with
    ``n_blocks`` layers (None: llama.cpp's architecture holds no such tensor)."""
    import gguf

    family = FAMILIES.get(model_type)
    if family is None:
        return None
    parts = hf.split(".")
    stack = next((k for k in ("switch_mlp", "experts") if k in parts), None)
    stacked = stack is not None and parts.index(stack) + 2 < len(parts)
    if stacked and parts[parts.index(stack) + 1].isdigit():  # one expert's own: not stacked
        stacked = False
    if stacked and len(parts) >= 3 and parts[2].isdigit():
        i = parts.index(stack)
        kind = _EXPERTS.get(parts[i + 1]) if i + 2 < len(parts) else None
        if kind is None or parts[-1] not in ("weight", "bias"):
            return None
        tensor = getattr(gguf.MODEL_TENSOR, kind)
        if tensor not in gguf.MODEL_TENSORS[_arch_code(family.arch)]:
            return None
        return f"{gguf.TENSOR_NAMES[tensor].format(bid=int(parts[2]))}.{parts[-1]}"
    if (
        model_type in QKV_LAYOUT
        and len(parts) >= 4
        and parts[-2] in _FUSED_QKV
        and parts[-1] in ("weight", "bias")
    ):  # split on export (tensors.qkv_split), joined on import
        block = next((p for p in parts if p.isdigit()), None)
        return None if block is None else f"blk.{int(block)}.attn_qkv.{parts[-1]}"
    if family.arch == "apertus" and parts[-2:-1] == ["act_fn"] and parts[-1] in XIELU:
        block = next((p for p in parts if p.isdigit()), None)
        return None if block is None else f"blk.{int(block)}.xielu.{parts[-1]}"
    if hf.endswith("shared_mlp.input_linear.weight") and parts[2].isdigit():
        return f"blk.{int(parts[2])}.{SHARED_GATE_UP}.weight"
    if family.arch == "openelm" and hf.endswith("ffn.proj_1.weight") and parts[2].isdigit():
        return f"blk.{int(parts[2])}.ffn_gate_up.weight"
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _MLA and parts[-1] == "weight" and len(parts) >= 3 and parts[2].isdigit():
        tensor = getattr(gguf.MODEL_TENSOR, _MLA[module])
        if tensor in gguf.MODEL_TENSORS[_arch_code(family.arch)]:
            return f"{gguf.TENSOR_NAMES[tensor].format(bid=int(parts[2]))}.weight"
    names = _name_map(family.arch, max(n_blocks, 1))
    name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    if name is None:  # mlx-lm's own prefix where the published checkpoint has another
        rest = hf.removeprefix("model.")
        for candidate in (
            rest,
            f"transformer.{rest}",
            f"backbone.{rest}",
            "gpt_neox." + rest.replace("h.", "layers.", 1),
            hf.replace(".gate.gate_proj.", ".gate."),  # Ling's router, as mlx-lm renames it
            *_renamed(hf, model_type),
        ):
            name = names.get_name(candidate, try_suffixes=(".weight", ".bias"))
            if name is not None:
                break
    if name is None and hf.endswith(".dt_bias"):  # Qwen3-Next's, as the converter renames it
        name = names.get_name(hf[: -len(".dt_bias")] + ".dt_proj.bias", try_suffixes=(".bias",))
    if name is None and hf.endswith("_bias"):  # DeepSeek-style e_score_correction_bias
        name = names.get_name(hf[: -len("_bias")] + ".bias", try_suffixes=(".weight", ".bias"))
    if name is not None and not name.endswith((".weight", ".bias")):
        # a bare parameter (gpt-oss's attention sinks, a router's expert bias; an SSM's A and
        # D keep the bare name)
        name += _BARE.get(name.rsplit(".", 1)[-1], ".weight")
    return name


__all__ = [
    "ARCHES", "DTYPES", "FAMILIES", "Family", "NORM_PLUS_ONE", "QKV_LAYOUT", "gguf_name",
    "llama_cpp_arch",
    "separate_qkv",
]  # fmt: skip
