"""Tensors as llama.cpp's converter writes them, and back: q/k rows in its interleaved rope
order, gemma's ``w + 1`` norms, conv kernels without their unit axis, SSM parameters
(``-exp(A_log)``, columns, groups), Qwen3-Next's split and Qwen3.5's tiled gated delta-net
tensors, Gemma 4's proportional-rotation factors; and a GGUF tensor de-quantized to float32."""

from __future__ import annotations

import numpy as np

from ..errors import UserInputError
from .file import GGUFTensor
from .names import GATE_UP, NORM_OFFSETS, XIELU


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from rotate-half to interleaved order (llama.cpp's convention)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def qkv_split(a: np.ndarray, layout: str, n_head: int, n_kv: int) -> list[np.ndarray]:
    """A fused q/k/v projection's rows (weight, bias or an adapter's B) as [q, k, v], from the
    model type's ``layout`` (names.QKV_LAYOUT)."""
    rest = a.shape[1:]
    hd = a.shape[0] // (n_head + 2 * n_kv)
    if layout == "contiguous":
        return np.split(a, [n_head * hd, (n_head + n_kv) * hd], axis=0)
    if layout == "per_head":
        x = a.reshape(n_head, 3, hd, *rest)
        return [x[:, i].reshape(-1, *rest) for i in range(3)]
    group = n_head // n_kv  # "grouped": each kv head's q rows, then its k and v
    x = a.reshape(n_kv, group + 2, hd, *rest)
    return [
        x[:, :group].reshape(-1, *rest),
        x[:, group].reshape(-1, *rest),
        x[:, group + 1].reshape(-1, *rest),
    ]


def qkv_join(q: np.ndarray, k: np.ndarray, v: np.ndarray, layout: str, n_head: int, n_kv: int):
    """The inverse of ``qkv_split``: one fused projection in the model type's layout."""
    rest = q.shape[1:]
    if layout == "contiguous":
        return np.concatenate([q, k, v], axis=0)
    hd = q.shape[0] // n_head
    if layout == "per_head":
        parts = [x.reshape(n_head, 1, hd, *rest) for x in (q, k, v)]
        return np.concatenate(parts, axis=1).reshape(-1, *rest)
    group = n_head // n_kv
    parts = [q.reshape(n_kv, group, hd, *rest)] + [x.reshape(n_kv, 1, hd, *rest) for x in (k, v)]
    return np.concatenate(parts, axis=1).reshape(-1, *rest)


def qkv_from_gguf(g, config: dict, layout: str, permuted: bool) -> None:
    """A family's fused q/k/v projections back from llama.cpp's three (q/k rows back in
    rotate-half order first, where the export interleaved them)."""
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    for i in range(config["num_hidden_layers"]):
        for suffix in ("weight", "bias"):
            names = [f"blk.{i}.attn_{x}.{suffix}" for x in "qkv"]
            fused = f"blk.{i}.attn_qkv.{suffix}"
            if fused in g.tensors:  # one tensor, all q rows first
                q, k, v = qkv_split(dequantized(g.tensors.pop(fused)), "contiguous", n_head, n_kv)
            elif all(n in g.tensors for n in names):
                q, k, v = (dequantized(g.tensors.pop(n)) for n in names)
            else:
                continue
            if permuted:
                q, k = unpermute_qk(q, n_head), unpermute_qk(k, n_kv)
            g.tensors[fused] = plain_tensor(fused, qkv_join(q, k, v, layout, n_head, n_kv))


def mla_split(a: np.ndarray, g: str, args):
    """A whole kv_b_proj (DeepSeek-V2's, Youtu's) as llama.cpp's converter splits it, or None
    for any other tensor: per head, the key part transposed [heads, kv_lora, nope]
    (attn_k_b) and the value part [heads, v, kv_lora] (attn_v_b)."""
    if not g.endswith("attn_kv_b.weight"):
        return None
    heads, nope = int(args.num_attention_heads), int(args.qk_nope_head_dim)
    per_head = a.reshape(heads, -1, a.shape[-1])
    block = g[: -len("attn_kv_b.weight")]
    return [
        (f"{block}attn_k_b.weight", per_head[:, :nope].swapaxes(1, 2)),
        (f"{block}attn_v_b.weight", per_head[:, nope:]),
    ]


def mla_join(g, config: dict) -> None:
    """A whole kv_b_proj back from llama.cpp's per-head key and value parts (the export's
    inverse)."""
    for i in range(config["num_hidden_layers"]):
        k_b = g.tensors.pop(f"blk.{i}.attn_k_b.weight", None)
        if k_b is None:
            continue
        v_b = dequantized(g.tensors.pop(f"blk.{i}.attn_v_b.weight"))
        k_b = dequantized(k_b).swapaxes(1, 2)  # [heads, nope, kv_lora]
        whole = np.concatenate([k_b, v_b], axis=1).reshape(-1, v_b.shape[-1])
        g.tensors[f"blk.{i}.attn_kv_b.weight"] = plain_tensor(f"blk.{i}.attn_kv_b.weight", whole)


def ssm_to_gguf(a: np.ndarray, g: str, args, arch: str = "mamba2") -> np.ndarray:
    """A Mamba tensor as llama.cpp's converter writes it: A as -exp(A_log); in Mamba 2's
    layout D and A as columns [heads, 1] and the gated norm per group [groups, inner / groups]
    (Mamba 1's A is [inner, state] and its D a vector already)."""
    if g.endswith(".ssm_a"):
        return -np.exp(a) if arch == "mamba" else -np.exp(a).reshape(-1, 1)
    if g.endswith(".ssm_d"):
        return a if arch == "mamba" else a.reshape(-1, 1)
    if g.endswith("ssm_norm.weight"):
        groups = getattr(args, "n_groups", None) or getattr(args, "mamba_n_groups", 1)
        return a.reshape(int(groups), -1)
    return a


def gemma4_rope_freqs(args) -> np.ndarray:
    """The full layers' "proportional" RoPE as llama.cpp's converter writes it: the rotated
    share of each head's frequency pairs as they are, the rest divided by 1e30 (unrotated)."""
    full = args.rope_parameters.get("full_attention", {})
    pairs = int(args.global_head_dim) // 2
    rotated = int(args.global_head_dim * float(full.get("partial_rotary_factor", 1.0)) / 2)
    return np.array([1.0] * rotated + [1e30] * (pairs - rotated), dtype=np.float32)


def norm_offset(arch: str, g: str) -> float:
    """The offset an architecture's RMSNorm adds to the weight named ``g`` (0: none)."""
    base = g.removesuffix(".weight").split(".")[-1]
    return (
        NORM_OFFSETS.get(arch, {}).get(base, 0.0) if g.startswith(("blk.", "output_norm")) else 0.0
    )


def shared_kv_heads(a: np.ndarray, g: str, n_head: int, n_kv: int, back: bool = False, lora=""):
    """PLaMo's q heads (rows of attn_q; columns of attn_output) from mlx-lm's order, where q
    head h reads kv head h % n_kv, to llama.cpp's, where it reads h // (n_head / n_kv)
    (``back``: the other way). ``lora``: an adapter's "a" or "b" factor of that tensor."""
    shared = n_head // n_kv
    rows = g.endswith(("attn_q.weight", "attn_q.bias")) and lora != "a"
    cols = g.endswith("attn_output.weight") and lora != "b"
    outer, inner = (n_kv, shared) if back else (shared, n_kv)
    if rows:
        rest = a.shape[1:]
        return a.reshape(outer, inner, -1, *rest).swapaxes(0, 1).reshape(a.shape)
    if cols:
        return a.reshape(a.shape[0], outer, inner, -1).swapaxes(1, 2).reshape(a.shape)
    return a


def llama4_qk_scale(g: str, args) -> float:
    """The factor on a roped Llama 4 layer's q/k rows that makes llama.cpp's q/k norm (at
    rms_norm_eps) equal mlx-lm's (at 1e-6): RMSNorm_e(c x) = RMSNorm_(e / c^2)(x)."""
    if args is None or not getattr(args, "use_qk_norm", False):
        return 1.0
    if not g.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        return 1.0
    if (int(g.split(".")[1]) + 1) % 4 == 0:  # unroped: no q/k norm
        return 1.0
    return float(np.sqrt(float(args.rms_norm_eps) / 1e-6))


# the scales llama.cpp's minicpm3 graph fixes (MiniCPM3-4B's)
MINICPM3_FIXED = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}


def minicpm3_scale(g: str, args, rows: int) -> np.ndarray | float:
    """The factor turning MiniCPM3's tensor ``g`` as mlx-lm runs it into what llama.cpp's
    minicpm3 graph (its scales fixed at MiniCPM3-4B's, its latent q/kv norms at rms_norm_eps
    where mlx-lm's are at 1e-5) computes alike: per row where it differs between rows."""
    if g == "token_embd.weight":
        return float(args.scale_emb) / MINICPM3_FIXED["scale_emb"]
    if g.endswith(("attn_output.weight", "ffn_down.weight")):
        return float(args.scale_depth) / MINICPM3_FIXED["scale_depth"]
    if g == "output.weight":  # mlx-lm's logits: lm_head(h * dim_model_base / hidden)
        return float(args.dim_model_base) / MINICPM3_FIXED["dim_model_base"]
    c = float(np.sqrt(float(args.rms_norm_eps) / 1e-5))
    if g.endswith("attn_q_a.weight"):
        return c
    if g.endswith("attn_kv_a_mqa.weight"):  # the latent rows, not the rotary ones
        out = np.ones((rows, 1), np.float32)
        out[: int(args.kv_lora_rank)] = c
        return out
    return 1.0


def minicpm3_rope_factors(args) -> np.ndarray:
    """mlx-lm's MiniCPM3 always divides by the long factors (llama.cpp picks long or short by
    the context: both are written as these)."""
    pairs = int(args.qk_rope_head_dim) // 2
    long = np.asarray((args.rope_scaling or {}).get("long_factor", 1.0), np.float32)
    return np.broadcast_to(long.reshape(-1), (pairs,)).astype(np.float32).copy()


# the width of the all-zero MLP that stands for a NAS layer's no-op MLP in llama.cpp's deci (whose
# graph would drop the whole layer for a width of 0)
DECI_NOOP_FFN = 32


def deci_layers(model) -> list[tuple[int, int, int]]:
    """A Nemotron-NAS model's layers as llama.cpp's deci reads them: (heads, kv heads, MLP
    width) each, off the built layers; a linear attention has heads and no kv heads, a no-op
    one neither (layer 0's is written as a linear attention of zeros: llama.cpp cannot load a
    layer 0 without heads); a no-op MLP is an all-zero one DECI_NOOP_FFN wide."""
    heads, out = int(model.args.num_attention_heads), []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        if attn is None:
            h, kv = (heads, 0) if i == 0 else (0, 0)
        elif hasattr(attn, "linear"):
            h, kv = heads, 0
        else:
            h, kv = heads, int(attn.n_kv_heads)
        mlp = layer.mlp
        if mlp is None:
            width = DECI_NOOP_FFN
        else:  # a linear MLP (refused for export) counts as hidden wide
            proj = mlp.gate_proj if hasattr(mlp, "gate_proj") else mlp.linear
            proj = getattr(proj, "linear", proj)  # under an adapter: its base layer
            width = int(proj.weight.shape[0])
        out.append((h, kv, width))
    return out


def deci_qk(a: np.ndarray, g: str, layers: list, back: bool = False) -> np.ndarray:
    """A Nemotron-NAS q/k projection's rows in llama.cpp's interleaved rope order, by its
    layer's heads and kv heads (``back``: to rotate-half again)."""
    if not g.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
        return a
    heads, kv, _ = layers[int(g.split(".")[1])]
    n = heads if ".attn_q." in g else kv
    return unpermute_qk(a, n) if back else permute_qk(a, n)


def deci_fillers(layers: list, hidden: int, no_op_mlp: list) -> list[tuple[str, np.ndarray]]:
    """The tensors standing for no-op sublayers in llama.cpp's deci: layer 0's attention as a
    linear one of zeros, a no-op MLP as an all-zero one (each behind a norm of ones)."""
    out = []
    for i, (heads, kv, width) in enumerate(layers):
        if i == 0 and heads and not kv:
            out += [("blk.0.attn_norm.weight", np.ones(hidden, np.float32))]
            out += [("blk.0.attn_output.weight", np.zeros((hidden, hidden), np.float32))]
        if width == DECI_NOOP_FFN and no_op_mlp[i]:
            out += [(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))]
            out += [
                (f"blk.{i}.ffn_{x}.weight", np.zeros((width, hidden), np.float32))
                for x in ("gate", "up")
            ]
            out += [(f"blk.{i}.ffn_down.weight", np.zeros((hidden, width), np.float32))]
    return out


def to_gguf(a: np.ndarray, g: str, family, n_head: int, n_kv: int) -> np.ndarray:
    """A parameter (fp32) as llama.cpp's converter stores it under GGUF name ``g``."""
    if family.permuted and g.endswith(("attn_q.weight", "attn_q.bias")):
        return permute_qk(a, n_head)
    if family.permuted and g.endswith(("attn_k.weight", "attn_k.bias")):
        return permute_qk(a, n_kv)
    if family.norm_plus_one and g.endswith("norm.weight"):
        return a + 1.0
    offset = norm_offset(family.arch, g)
    if offset:
        return a + offset
    if g.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")):  # MLX's [C, K, 1] -> [C, K]
        return a.reshape(a.shape[0], a.shape[1])
    if g.endswith(("ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")):
        return a.swapaxes(1, 2)  # Kimi Linear's: MLX's [C, K, 1] -> [C, 1, K]
    return a


def _tiled_v_heads(a: np.ndarray, axis: int, args, head_dim: int) -> np.ndarray:
    """V heads along ``axis`` from grouped by key head (HF: k0's v heads, then k1's) to tiled
    (v0 of every key head, then v1 ...), the order llama.cpp's qwen35 broadcasts in."""
    nk = args.linear_num_key_heads
    r = args.linear_num_value_heads // nk
    moved = np.moveaxis(a, axis, 0)
    tiled = moved.reshape(nk, r, head_dim, *moved.shape[1:]).swapaxes(0, 1)
    return np.moveaxis(tiled.reshape(moved.shape), 0, axis)


def qwen35_to_gguf(a: np.ndarray, g: str, args, lora: str = "") -> np.ndarray:
    """A Qwen3.5 gated delta-net tensor (or one LoRA factor of it: ``lora`` "a" or "b") as
    llama.cpp's converter writes it: V heads tiled, A as -exp(A_log)."""
    if lora != "a" and g.endswith(".ssm_a"):
        a = -np.exp(a)
    if args.linear_num_key_heads == args.linear_num_value_heads:
        return a
    dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
    qk = 2 * args.linear_num_key_heads * dk
    if lora == "a":  # an adapter's A factor: only ssm_out's input columns are V heads
        return _tiled_v_heads(a, 1, args, dv) if g.endswith("ssm_out.weight") else a
    if g.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        return np.concatenate([a[:qk], _tiled_v_heads(a[qk:], 0, args, dv)], axis=0)
    if g.endswith("attn_gate.weight"):
        return _tiled_v_heads(a, 0, args, dv)
    if g.endswith(("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias", ".ssm_a")):
        return _tiled_v_heads(a, 0, args, 1)
    if g.endswith("ssm_out.weight") and lora != "b":
        return _tiled_v_heads(a, 1, args, dv)
    return a


def qwen3_next_split(a: np.ndarray, g: str, args):
    """Qwen3-Next's gated delta-net tensors as llama.cpp's converter writes them, or None for
    any other tensor: the fused q/k/v/z projection (grouped per key head) as one q/k/v
    projection and a z gate, A as -exp(A_log), the conv kernel without its unit axis."""
    if g.endswith("ssm_in.weight"):
        nk, dk = args.linear_num_key_heads, args.linear_key_head_dim
        nv, dv = args.linear_num_value_heads, args.linear_value_head_dim
        per = [dk, dk, nv // nk * dv, nv // nk * dv]
        grouped = a.reshape(nk, sum(per), a.shape[-1])
        q, k, v, z = np.split(grouped, np.cumsum(per)[:-1], axis=1)
        flat = [x.reshape(-1, a.shape[-1]) for x in (q, k, v, z)]
        block = g[: -len("ssm_in.weight")]
        return [
            (f"{block}attn_qkv.weight", np.concatenate(flat[:3], axis=0)),
            (f"{block}attn_gate.weight", flat[3]),
        ]
    if g.endswith(".ssm_a"):
        return [(g, -np.exp(a))]
    return None


def ssm_from_gguf(g, config: dict) -> None:
    """Mamba's A, D and gated norm back in mlx-lm's form: A_log from A; Mamba 2's each a
    vector."""
    flat = g.arch != "mamba"  # Mamba 1's A stays [inner, state]
    for i in range(config["num_hidden_layers"]):
        for name, fix in (
            ("ssm_a", lambda x: np.log(-x).reshape(-1) if flat else np.log(-x)),
            ("ssm_d", lambda x: x.reshape(-1)),
            ("ssm_norm.weight", lambda x: x.reshape(-1)),
        ):
            t = g.tensors.get(f"blk.{i}.{name}")
            if t is not None:
                g.tensors[f"blk.{i}.{name}"] = plain_tensor(f"blk.{i}.{name}", fix(dequantized(t)))


def unpermute_qk(a: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from llama.cpp's interleaved order back to rotate-half (the
    inverse of ``export.permute_qk``); works on any trailing shape, codes and scales too."""
    rows = a.shape[0]
    return a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


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


def qwen3_next_join(g, config: dict) -> None:
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
            g.tensors[f"blk.{i}.ssm_in.weight"] = plain_tensor(f"blk.{i}.ssm_in.weight", fused)
        a = g.tensors.pop(f"blk.{i}.ssm_a", None)
        if a is not None:
            g.tensors[f"blk.{i}.ssm_a"] = plain_tensor(f"blk.{i}.ssm_a", np.log(-dequantized(a)))


def qwen35_from_gguf(g, text: dict) -> None:
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
            g.tensors[name] = plain_tensor(name, x)


def plain_tensor(name: str, a: np.ndarray) -> GGUFTensor:
    """A float32 tensor made here, held as the file's plain tensors are."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    return GGUFTensor(name, 0, tuple(reversed(a.shape)), a)


def xielu_from_gguf(g, config: dict) -> None:
    """Apertus's xIELU parameters, metadata arrays in the file, as the model's per-layer
    scalars."""
    for key in XIELU:
        values = g.fields.get(f"xielu.{key}")
        if values is None:
            raise UserInputError(f"the metadata has no xielu.{key}", str(g.path))
        values = [float(x) for x in values]
        for i in range(config["num_hidden_layers"]):
            name = f"blk.{i}.xielu.{key}"
            g.tensors[name] = GGUFTensor(name, 0, (), np.array(values[i], dtype=np.float32))


def gate_up_join(g, layers: int, joined: str) -> None:
    """A joined gate-then-up matrix back from llama.cpp's two tensors (Granite's shared MLP,
    OpenELM's proj_1: the export splits them)."""
    gate_name, up_name = GATE_UP[joined]
    for i in range(layers):
        gate = g.tensors.pop(f"blk.{i}.{gate_name}.weight", None)
        if gate is not None:
            up = dequantized(g.tensors.pop(f"blk.{i}.{up_name}.weight"))
            name = f"blk.{i}.{joined}.weight"
            g.tensors[name] = plain_tensor(name, np.concatenate([dequantized(gate), up]))
