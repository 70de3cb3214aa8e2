"""Every model type mlx-lm ships either trains under mlxtune or is refused by name, with the
reason read off the model (tests/mlx_lm_archs.py builds a tiny random model of each). The
families people fine-tune today train end to end: LoRA in the default run; DoRA, full
fine-tuning, DPO, GRPO and exact resume under ``-m slow``."""

import dataclasses
import json
import pkgutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm_archs import ARCHS, EXTRA_ARCHS, NOT_MODELS, tiny_config
from test_interop import interop

from conftest import TIMING, tiny_recipe, write_jsonl
from mlxtune import Trainer, recipe_from_dict
from mlxtune.adapters import apply_adapters
from mlxtune.errors import UserInputError
from mlxtune.kernels import linear_cross_entropy
from mlxtune.models import (
    build_model,
    dequantize_for_training,
    family_classes,
    kernel_attention,
    lm_parts,
    packing_refusal,
    save_model,
    segments,
)
from mlxtune.models.configs import normalise_config
from mlxtune.models.moe import router_paths

# the types issue 33 names, and Mistral 3
NAMED = [
    "gemma3_text",
    "gemma4_text",
    "smollm3",
    "olmo2",
    "granite",
    "mixtral",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_next",
    "qwen3_5",
    "lfm2",
    "nemotron_h",
    "ministral3",
]
# named families whose fused export transformers does not run as mlx-lm does, and why
TRANSFORMERS_DIFFERS = {
    "gpt_oss": "mlx-lm reads experts in a layout transformers does not write (saved as held)",
    "deepseek_v3": "transformers' own forward fails at this tiny size (checked on the layout)",
    "qwen3_5": "mlx-lm's qwen3_5 is the multimodal wrapper; transformers' text model differs",
    # equal with sliding_window null (checked by hand: 8e-7); with a window, transformers'
    # Ministral 3 slides it on every layer, mlx-lm on the layer_types' sliding layers alone
    "ministral3": "the two read sliding_window differently (the test config sets one)",
    # equal before training; once the SSM's dt falls under 0.001, transformers clamps it to
    # time_step_min and mlx-lm to time_step_limit[0] (0)
    "nemotron_h": "transformers clamps the SSM step at time_step_min, mlx-lm does not",
}
VOCAB = 64  # the test tokenizer has 60 pieces


def mlx_lm_modules() -> list[str]:
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__))


def test_every_mlx_lm_module_is_known_to_the_tests():
    """A new mlx-lm release's new model type fails here until it has a tiny architecture."""
    known = set(ARCHS) | set(NOT_MODELS)
    assert [m for m in mlx_lm_modules() if m not in known] == []
    assert set(EXTRA_ARCHS) <= set(NOT_MODELS)


def trains(name: str):
    """Build the tiny model of ``name``: None when a LoRA step on every linear layer computes
    the model's own loss with finite, nonzero gradients, else the UserInputError's message."""
    model, _ = build_model(tiny_config(name, VOCAB), VOCAB, seed=1)
    try:
        parts = lm_parts(model)
    except UserInputError as e:
        return e.message
    x = mx.array([[1, 5, 9, 12, 7, 3, 4, 8, 2]])
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    for _, m in model.named_modules():  # a trained-looking adapter (B starts at 0)
        if "lora_b" in m:
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05

    def loss(model):
        h = parts.hidden(x[:, :-1])[0]
        return linear_cross_entropy(
            parts.loss_hidden(h), parts.head_weight(), x[0, 1:], softcap=parts.softcap
        )[0]

    def naive(model):  # cross-entropy of the model's own logits (mlx-lm's forward, unpatched)
        logits = model(x[:, :-1])[0].astype(mx.float32)
        return (mx.logsumexp(logits, axis=-1) - logits[mx.arange(8), x[0, 1:]]).sum()

    value, grads = nn.value_and_grad(model, loss)(model)
    want, want_grads = nn.value_and_grad(model, naive)(model)
    assert value.item() == pytest.approx(want.item(), rel=1e-4), name
    want_grads = dict(tree_flatten(want_grads))
    for k, g in tree_flatten(grads):
        np.testing.assert_allclose(
            np.array(g), np.array(want_grads[k]), rtol=1e-3, atol=1e-5, err_msg=f"{name} {k}"
        )
    flat = tree_flatten(grads)
    assert flat and all(k.endswith(("lora_a", "lora_b")) for k, _ in flat), name
    norms = np.array([float(mx.abs(g).sum()) for _, g in flat])
    assert np.isfinite(norms).all() and norms.sum() > 0, name
    found = parts
    for kind in ("dora", "full"):  # the other adapters' gradients, finite and nonzero
        model, _ = build_model(tiny_config(name, VOCAB), VOCAB, seed=1)
        parts = dataclasses.replace(found, model=model)  # the same head, found once
        if kind == "full" and dequantize_for_training(model)[1]:
            continue  # a family built quantized (its own layers): full fine-tuning is refused
        apply_adapters(model, kind, 4, 8.0, 0.0, ["all-linear"])
        _, grads = nn.value_and_grad(model, loss)(model)
        norms = np.array([float(mx.abs(g).sum()) for _, g in tree_flatten(grads)])
        assert norms.size and np.isfinite(norms).all() and norms.sum() > 0, (name, kind)
    return None


def test_every_mlx_lm_model_type_trains_or_is_refused_by_name():
    refused = {}
    for name in sorted(ARCHS):
        why = trains(name)
        if why is not None:
            family = tiny_config(name)["model_type"]
            assert f"model type {family!r}" in why, why
            refused[name] = why
    # the exceptions are few, and each says why (what MLX or the family's code does)
    assert len(refused) <= 4, refused
    assert not set(refused) & set(NAMED)


def test_the_readmes_family_table_is_current():
    """The table in docs/models.md is what tests/families_table.py reads off the models now."""
    from families_table import all_supports, block, readme_block

    assert readme_block() == block(all_supports()), "run: python tests/families_table.py --write"


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, tokenizer, tokenizer_dir):
    made = {}

    def make(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp(f"family-{name}")
            # mlx-lm's own initialisation: livelier than the small normal init of build_model
            mx.random.seed(2)
            config = {**tiny_config(name, VOCAB), "pad_token_id": 0}  # in the vocabulary
            model_class, args_class = family_classes(config)
            model = model_class(args_class.from_dict(normalise_config(config, args_class)))
            for path in router_paths(model):  # some start at zero: every expert ties
                router = dict(model.named_modules())[path]
                router.weight = 0.1 * mx.random.normal(router.weight.shape)
            save_model(model, config, out, tokenizer, tokenizer_dir)
            made[name] = out
        return made[name]

    return make


def run(tmp_path, data_dir, model_dir, **sections):
    r = tiny_recipe(data_dir, model_dir, **sections)
    r["train"] = {**r["train"], "max_steps": 16, "log_every": 1}
    r["schedule"] = {"name": "constant"}
    r["eval"] = {"every": None}
    r.setdefault("adapter", {})
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / "run")
    tr.run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row and "eval_loss" not in row]
    return tr, losses


def learned(losses) -> bool:
    """Finite, and the last three steps' mean loss well under the first step's."""
    return bool(np.isfinite(losses).all()) and np.mean(losses[-3:]) < losses[0] - 0.1


LORA = {"type": "lora", "rank": 4, "alpha": 16, "targets": ["all-linear"]}


# the default run trains one family of each kind (mixture of experts, hybrid, a scaled head);
# -m slow every named family
QUICK = ["qwen3_moe", "lfm2", "granite"]


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in NAMED]
)
def test_named_family_trains_with_lora(name, tmp_path, data_dir, family_dir):
    tr, losses = run(tmp_path, data_dir, family_dir(name), adapter=LORA, optimizer={"lr": 1e-1})
    assert learned(losses), losses
    # packing is allowed: the recurrent layers (gated delta, SSD, short convolutions) of the
    # hybrids among them restart per packed example
    assert packing_refusal(tr.model, tr.built.components.lm) is None


def write_pairs(d):
    rows = [
        {"prompt": f"reverse {w} =", "chosen": f" {w[::-1]}", "rejected": f" {w}"}
        for w in ["abc", "dog", "cat", "tree", "mouse", "sun", "blue", "green"] * 3
    ]
    write_jsonl(d / "pairs.jsonl", rows)
    return d / "pairs.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dora", "full"])
@pytest.mark.parametrize("name", NAMED)
def test_named_family_trains_with_dora_and_in_full(name, kind, tmp_path, data_dir, family_dir):
    adapter = {**LORA, "type": kind} if kind == "dora" else {"type": "full"}
    lr = 3e-2 if kind == "dora" else 3e-3
    _, losses = run(tmp_path, data_dir, family_dir(name), adapter=adapter, optimizer={"lr": lr})
    assert learned(losses), losses


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMED)
def test_named_family_trains_with_dpo_and_grpo(name, tmp_path, data_dir, family_dir):
    pairs = write_pairs(tmp_path)
    data = {"train": str(pairs), "valid": str(pairs), "max_length": 48}
    tr, losses = run(
        tmp_path / "dpo",
        data_dir,
        family_dir(name),
        adapter=LORA,
        data=data,
        objective={"type": "dpo", "beta": 0.5},
        optimizer={"lr": 1e-2},
    )
    assert learned(losses), losses
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": f"reverse {w} ="} for w in ["abc", "dog", "cat", "sun"]])
    tr, losses = run(
        tmp_path / "grpo",
        data_dir,
        family_dir(name),
        adapter=LORA,
        data={"train": str(prompts), "valid": str(prompts), "max_length": 48},
        objective={
            "type": "grpo",
            "rewards": [{"name": "length", "target": 3}],
            "num_generations": 4,
            "max_completion_length": 6,
        },
        optimizer={"lr": 1e-2},
    )
    assert all(np.isfinite(losses))


def packed_gradients_match(name: str) -> bool | None:
    """None when the family refuses packing; else whether a packed row's LoRA loss and
    gradients equal the sum of its two examples' run one by one."""
    model, _ = build_model(tiny_config(name, VOCAB), VOCAB, seed=3)
    try:
        parts = lm_parts(model)
    except UserInputError:
        return None
    if packing_refusal(model, parts) is not None:
        return None
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
    for _, m in model.named_modules():
        if "lora_b" in m:
            m.lora_b = mx.random.normal(m.lora_b.shape) * 0.05
    a, b = [1, 5, 9, 12, 7, 3], [4, 8, 2, 6, 11]

    def loss_of(ids, seg=None):
        def loss(model):
            x = mx.array([ids])
            with kernel_attention(model, "chunked"), segments(None if seg is None else seg[:, :-1]):
                h = parts.hidden(x[:, :-1])[0]
            t = mx.array(ids[1:])
            if seg is not None:  # no target across the seam
                t = mx.where(seg[0, 1:] == seg[0, :-1], t, -100)
            return linear_cross_entropy(
                parts.loss_hidden(h), parts.head_weight(), t, softcap=parts.softcap
            )[0]

        return nn.value_and_grad(model, loss)(model)

    seg = mx.array([[1] * len(a) + [2] * len(b)])
    packed, pg = loss_of(a + b, seg)
    la, ga = loss_of(a)
    lb, gb = loss_of(b)
    if abs(packed.item() - (la + lb).item()) > 1e-4 * abs(packed.item()):
        return False
    ga, gb = dict(tree_flatten(ga)), dict(tree_flatten(gb))
    for k, g in tree_flatten(pg):
        if not np.allclose(np.array(g), np.array(ga[k] + gb[k]), rtol=1e-3, atol=1e-5):
            return False
    return True


def test_packed_rows_train_as_their_examples_one_by_one_in_every_family():
    checked = {name: packed_gradients_match(name) for name in sorted(ARCHS)}
    assert [n for n, ok in checked.items() if ok is False] == []
    assert sum(ok is True for ok in checked.values()) >= 80
    assert all(checked[n] for n in NAMED)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMED)
def test_named_family_resumes_exactly(name, tmp_path, data_dir, family_dir):
    from conftest import make_crash, same_rows
    from mlxtune.console import Console

    r = tiny_recipe(
        data_dir,
        family_dir(name),
        adapter={**LORA, "dropout": 0.1},
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 4},
        checkpoints={"every": 3},
    )

    def rows(d):
        skip = TIMING
        lines = (d / "metrics.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(x).items() if k not in skip and "compile" not in k}
            for x in lines
        ]

    quiet = Console(quiet=True)
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "whole", console=quiet).run()
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(
            recipe_from_dict(r), run_dir=tmp_path / "cut", console=quiet, callbacks=[make_crash(5)]
        ).run()
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "cut", console=quiet, resume="latest").run()
    same_rows(rows(tmp_path / "cut"), rows(tmp_path / "whole"))


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in NAMED]
)
def test_named_family_fused_export_is_the_adapted_model(name, tmp_path, data_dir, family_dir):
    """The fused export runs as the trained model in mlx-lm, and in transformers where it has
    the family (experts, conv weights and norms in the published layout)."""
    from mlx_lm.utils import load as mlx_lm_load
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    tr, _ = run(
        tmp_path,
        data_dir,
        family_dir(name),
        adapter=LORA,
        optimizer={"lr": 1e-1},
        export={"formats": ["mlx-lm", "fused"]},
    )
    tr.model.eval()
    ids = mx.array([tr.train_set.examples[0].ids])
    want = np.array(tr.model(ids).astype(mx.float32))
    fused, _ = mlx_lm_load(str(tmp_path / "run" / "export" / "fused"))
    np.testing.assert_allclose(np.array(fused(ids)), want, rtol=1e-4, atol=1e-4)
    with_adapter, _ = mlx_lm_load(
        str(family_dir(name)), adapter_path=str(tmp_path / "run" / "export" / "mlx-lm")
    )
    np.testing.assert_allclose(np.array(with_adapter(ids)), want, rtol=1e-4, atol=1e-4)
    held = "the fused weights keep mlx-lm's layout" in (tmp_path / "run" / "log.txt").read_text()
    assert held == (name == "gpt_oss")  # the one named family with no published layout
    if name in TRANSFORMERS_DIFFERS or name not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    torch = interop("torch")
    from test_interop import from_pretrained

    hf = from_pretrained(torch, tmp_path / "run" / "export" / "fused")
    with torch.no_grad():
        got = hf(torch.tensor(np.array(ids))).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def test_full_fine_tuning_of_a_quantized_checkpoint_trains_it_de_quantized(
    tmp_path, data_dir, tokenizer, tokenizer_dir
):
    """An mlx-community style 8-bit checkpoint of a mixture of experts (its experts quantized
    too) trains in full: de-quantized first, its logits unchanged by that."""
    from mlx_lm.utils import quantize_model

    from mlxtune.models import load_model

    mx.random.seed(2)
    config = tiny_config("qwen3_moe", VOCAB)
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(config))
    model, config = quantize_model(model, config, group_size=32, bits=8)
    assert any("scales" in m for _, m in model.named_modules())
    save_model(model, config, tmp_path / "q8", tokenizer, tokenizer_dir)
    loaded, _ = load_model(tmp_path / "q8")
    ids = mx.array([[1, 5, 9, 12, 7, 3]])
    want = np.array(loaded(ids))
    n, left = dequantize_for_training(loaded)
    assert n > 0 and left == []
    assert not any("scales" in m for _, m in loaded.named_modules())
    np.testing.assert_allclose(np.array(loaded(ids)), want, rtol=1e-4, atol=1e-4)
    tr, losses = run(
        tmp_path, data_dir, tmp_path / "q8", adapter={"type": "full"}, optimizer={"lr": 3e-3}
    )
    assert learned(losses), losses
    assert "de-quantized" in (tmp_path / "run" / "log.txt").read_text()


@pytest.mark.parametrize("name", ["qwen3_moe", "lfm2", "gemma3_text"])
def test_gradient_checkpointing_gives_the_same_gradients_in_moe_and_hybrid_blocks(name):
    from mlxtune.models import checkpoint_layers, checkpointed_layers

    def grads(checkpointed: bool):
        model, _ = build_model(tiny_config(name, VOCAB), VOCAB, seed=5)
        parts = lm_parts(model)
        apply_adapters(model, "lora", 4, 8.0, 0.0, ["all-linear"])
        for _, m in model.named_modules():
            if "lora_b" in m:
                m.lora_b = mx.ones(m.lora_b.shape) * 0.03
        if checkpointed:
            assert checkpoint_layers(model) == checkpointed_layers(model) == len(model.layers)
        x = mx.array([[1, 5, 9, 12, 7, 3, 4, 8, 2]])

        def loss(model):
            h = parts.hidden(x[:, :-1])[0]
            return linear_cross_entropy(
                parts.loss_hidden(h), parts.head_weight(), x[0, 1:], softcap=parts.softcap
            )[0]

        return dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))

    plain, again = grads(False), grads(True)
    assert plain.keys() == again.keys()
    for k in plain:
        np.testing.assert_allclose(np.array(again[k]), np.array(plain[k]), rtol=1e-4, atol=1e-6)


# PEFT's module names are transformers' (the published layout's): LFM2-MoE renames its dense MLP
PEFT_FAMILIES = [n for n in NAMED if n not in TRANSFORMERS_DIFFERS] + ["lfm2_moe"]


@pytest.mark.parametrize(
    "name",
    [
        n if n in QUICK + ["lfm2_moe"] else pytest.param(n, marks=pytest.mark.slow)
        for n in PEFT_FAMILIES
    ],
)
def test_peft_applies_the_peft_export_over_the_published_base(name, tmp_path, data_dir, family_dir):
    torch = interop("torch")
    peft = interop("peft")
    from test_interop import from_pretrained

    moe = any("switch_mlp" in k for k, _ in tree_flatten(load_family(family_dir(name))))
    adapter = {
        **LORA,
        "targets": ["q_proj", "k_proj", "v_proj", "o_proj"] if moe else LORA["targets"],
    }
    if name == "lfm2_moe":  # every linear layer of its dense block (conv, attention, w1/w2/w3)
        adapter = {**LORA, "layers": [0]}
    tr, _ = run(
        tmp_path,
        data_dir,
        family_dir(name),
        adapter=adapter,
        optimizer={"lr": 1e-1},
        export={"formats": ["peft"]},
    )
    tr.model.eval()
    ids = [tr.train_set.examples[0].ids]
    want = np.array(tr.model(mx.array(ids)).astype(mx.float32))
    base = from_pretrained(torch, family_dir(name))
    with torch.no_grad():
        before = base(torch.tensor(ids)).logits.numpy()
    assert np.abs(before - want).max() > 1e-2  # the adapter moved the logits
    if name == "lfm2_moe":
        written = mx.load(str(tmp_path / "run" / "export" / "peft" / "adapter_model.safetensors"))
        assert any(".feed_forward.w1.lora_A" in k for k in written), sorted(written)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "run" / "export" / "peft"))
    with torch.no_grad():
        got = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


def load_family(path):
    from mlxtune.models import load_model

    return load_model(path)[0].parameters()


@pytest.mark.parametrize("mode, bits", [("affine", 4), ("mxfp4", 4)])
@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in NAMED]
)
def test_lora_over_a_pre_quantized_checkpoint_trains_and_exports(
    name, mode, bits, tmp_path, data_dir, tokenizer, tokenizer_dir
):
    """An mlx-community style checkpoint (4-bit affine, or mxfp4 as gpt-oss's are), experts
    quantized too: LoRA trains over the codes as they are, the mlx-lm adapter loads over the
    checkpoint in mlx-lm, and the fused export (de-quantized) is the trained model."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_lm.utils import quantize_model

    from mlxtune.cli import main

    mx.random.seed(2)
    config = {**tiny_config(name, VOCAB), "pad_token_id": 0}
    model_class, args_class = family_classes(config)
    model = model_class(args_class.from_dict(normalise_config(config, args_class)))
    for path in router_paths(model):
        router = dict(model.named_modules())[path]
        router.weight = 0.1 * mx.random.normal(router.weight.shape)
    model, config = quantize_model(model, config, group_size=32, bits=bits, mode=mode)
    save_model(model, config, tmp_path / "q", tokenizer, tokenizer_dir)
    tr, losses = run(
        tmp_path,
        data_dir,
        tmp_path / "q",
        adapter=LORA,
        optimizer={"lr": 1e-1},
        export={"formats": ["mlx-lm"]},
    )
    assert learned(losses), losses
    held = [m for _, m in tr.model.named_modules() if getattr(m, "mode", None) == mode]
    assert held, "the base was not kept quantized"
    tr.model.eval()
    ids = mx.array([tr.train_set.examples[0].ids])
    want = np.array(tr.model(ids).astype(mx.float32))
    # mxfp4's products on the CPU round differently from one path to another (~3e-4 of the
    # largest logit seen); the adapter moves the logits by far more than either tolerance
    tol = (1e-4 if mode == "affine" else 2e-3) * max(1.0, np.abs(want).max())
    base, _ = mlx_lm_load(str(tmp_path / "q"))
    assert np.abs(np.array(base(ids)) - want).max() > 20 * tol
    with_adapter, _ = mlx_lm_load(
        str(tmp_path / "q"), adapter_path=str(tmp_path / "run" / "export" / "mlx-lm")
    )
    np.testing.assert_allclose(np.array(with_adapter(ids)), want, rtol=0, atol=tol)
    out = tmp_path / "fused"
    assert main(["export", str(tmp_path / "run"), "--format", "fused", "--out", str(out)]) == 0
    fused, _ = mlx_lm_load(str(out))  # de-quantized: the quantized products' rounding differs
    np.testing.assert_allclose(np.array(fused(ids)), want, rtol=0, atol=max(10 * tol, 1e-3))


def test_dbrxs_mixture_trains_in_a_compiled_step_as_mlx_lms_computes_it():
    """DBRX's training forward reads its routing through NumPy, which no compiled step can run:
    inside kernel_attention its mixture runs every expert weighted by the router's normalised
    top-k scores. Its values and gradients are mlx-lm's own (its host-side training forward,
    uncompiled), and the same call compiles."""
    from mlxtune.models import kernel_attention

    model, _ = build_model(tiny_config("dbrx", VOCAB), VOCAB, seed=1)
    for path in router_paths(model):  # a router that picks different experts per token
        router = dict(model.named_modules())[path]
        router.weight = mx.random.normal(router.weight.shape, key=mx.random.key(3))
    x = mx.array([[1, 5, 9, 12, 7, 3, 4, 8, 2, 30, 11]])
    model.train()

    def loss(x):
        logits = model(x[:, :-1]).astype(mx.float32)
        return (mx.logsumexp(logits, axis=-1) - mx.take_along_axis(
            logits, x[:, 1:, None], axis=-1
        )[..., 0]).sum()  # fmt: skip

    want, want_grads = nn.value_and_grad(model, loss)(x)  # mlx-lm's, through NumPy
    with kernel_attention(model):
        step = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state])
        got, grads = step(x)
    assert type(dict(model.named_modules())["transformer.blocks.0.ffn"]).__name__ == (
        "SparseMoeBlock"
    )  # restored on exit
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    want_grads = dict(tree_flatten(want_grads))
    for k, g in tree_flatten(grads):
        np.testing.assert_allclose(np.array(g), np.array(want_grads[k]), rtol=1e-4, atol=1e-6)
