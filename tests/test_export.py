"""Export and import: every format written, loaded back by the tool that consumes it (or by
mlxtune's importer), and compared by logits."""

import json

import mlx.core as mx
import numpy as np
import pytest

from conftest import tiny_recipe
from mlxtune import Trainer, recipe_from_dict
from mlxtune.adapters import apply_adapters
from mlxtune.cli import main
from mlxtune.errors import UserInputError
from mlxtune.export import import_adapter, read_adapter
from mlxtune.models import load_model
from mlxtune.runs.checkpoint import load_trained

ADAPTERS = {
    "lora": {
        "type": "lora",
        "rank": 4,
        "alpha": 8,
        "targets": ["q_proj", "v_proj", "down_proj"],
        "layers": "1-1",
        "rslora": True,  # scaled by alpha / sqrt(rank): every export must carry it
    },
    "dora": {"type": "dora", "rank": 4, "alpha": 8, "targets": ["all-linear"]},
}


def export_cli(*args) -> int:
    """mlxtune export ARGS...; the exit code."""
    return main(["export", *map(str, args)])


def trained_run(tmp_path, data_dir, llama_dir, kind, formats):
    r = tiny_recipe(data_dir, llama_dir, adapter=ADAPTERS[kind], export={"formats": formats})
    r["optimizer"] = {"lr": 5e-2}
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / kind)
    tr.run()
    tr.model.eval()
    return tr


def logits(model, ids):
    return np.array(model(mx.array([ids])).astype(mx.float32))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_every_format_round_trips_with_the_same_logits(tmp_path, data_dir, llama_dir, kind):
    from mlx_lm.utils import load as mlx_lm_load

    tr = trained_run(tmp_path, data_dir, llama_dir, kind, ["mlx-lm", "peft"])
    ids = tr.train_set.examples[0].ids
    want = logits(tr.model, ids)
    base_logits = logits(load_model(llama_dir)[0], ids)
    assert np.abs(want - base_logits).max() > 1e-3  # the adapter changed something
    run = tmp_path / kind
    # the checkpoint alone rebuilds the model
    np.testing.assert_allclose(logits(load_trained(run).model, ids), want, rtol=1e-4, atol=1e-4)
    # mlx-lm loads its format
    model, _ = mlx_lm_load(str(llama_dir), adapter_path=str(run / "export" / "mlx-lm"))
    np.testing.assert_allclose(logits(model, ids), want, rtol=1e-4, atol=1e-4)
    # PEFT's format: names and orientation as PEFT writes them, and it imports back exactly
    peft_cfg = json.loads((run / "export" / "peft" / "adapter_config.json").read_text())
    assert peft_cfg["peft_type"] == "LORA" and peft_cfg["r"] == 4 and peft_cfg["lora_alpha"] == 8
    assert peft_cfg["use_dora"] == (kind == "dora")
    assert peft_cfg["use_rslora"] == (kind == "lora")
    peft_w = mx.load(str(run / "export" / "peft" / "adapter_model.safetensors"))
    a_key = next(k for k in peft_w if k.endswith("self_attn.q_proj.lora_A.weight"))
    assert a_key.startswith("base_model.model.model.layers.1.") and peft_w[a_key].shape == (4, 32)
    assert peft_w[a_key.replace("lora_A", "lora_B")].shape[1] == 4
    fresh, _ = load_model(llama_dir)
    a = ADAPTERS[kind]
    apply_adapters(fresh, a["type"], 4, 8.0, 0.0, a["targets"], a.get("layers"), kind == "lora")
    import_adapter(fresh, run / "export" / "peft")
    fresh.eval()
    np.testing.assert_allclose(logits(fresh, ids), want, rtol=1e-4, atol=1e-4)
    # fused: mlx-lm loads the merged model with the same outputs
    assert main(["export", str(run), "--format", "fused"]) == 0
    fused, _ = mlx_lm_load(str(run / "export" / "fused"))
    np.testing.assert_allclose(logits(fused, ids), want, rtol=1e-4, atol=1e-4)
    assert not any(
        "lora" in k for k in mx.load(str(run / "export" / "fused" / "model.safetensors"))
    )


def test_fused_export_in_another_dtype(tmp_path, data_dir, llama_dir):
    trained_run(tmp_path, data_dir, llama_dir, "lora", [])
    out = tmp_path / "f16"
    assert (
        export_cli(
            str(tmp_path / "lora"), "--format", "fused", "--out", str(out), "--dtype", "float16"
        )
        == 0
    )
    w = mx.load(str(out / "model.safetensors"))
    assert all(v.dtype == mx.float16 for v in w.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


def test_a_run_can_start_from_an_exported_adapter(tmp_path, data_dir, llama_dir):
    tr = trained_run(tmp_path, data_dir, llama_dir, "lora", ["peft"])
    ids = tr.train_set.examples[0].ids
    r = tiny_recipe(
        data_dir,
        llama_dir,
        adapter={**ADAPTERS["lora"], "init_from": str(tmp_path / "lora" / "export" / "peft")},
    )
    again = Trainer(recipe_from_dict(r), run_dir=tmp_path / "again")
    again.model.eval()
    np.testing.assert_allclose(
        logits(again.model, ids), logits(tr.model, ids), rtol=1e-4, atol=1e-4
    )


def test_mismatched_adapter_is_refused(tmp_path, data_dir, llama_dir):
    trained_run(tmp_path, data_dir, llama_dir, "lora", ["mlx-lm"])
    other = {
        **ADAPTERS["lora"],
        "rank": 2,
        "init_from": str(tmp_path / "lora" / "export" / "mlx-lm"),
    }
    with pytest.raises(UserInputError, match="shape"):
        Trainer(
            recipe_from_dict(tiny_recipe(data_dir, llama_dir, adapter=other)),
            run_dir=tmp_path / "x",
        )


def test_export_errors_exit_2(tmp_path, data_dir, llama_dir, capsys):
    trained_run(tmp_path, data_dir, llama_dir, "lora", ["mlx-lm"])
    run = tmp_path / "lora"
    assert (
        main(["export", str(run), "--format", "mlx-lm"]) == 2
    )  # already there: nothing is overwritten
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--format", "peft"]) == 2
    assert "not a run directory" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "gguf-nope"]) == 2
    with pytest.raises(UserInputError, match="no adapter_config.json"):
        read_adapter(tmp_path)


def test_full_fine_tune_exports_fused_only(tmp_path, data_dir, llama_dir, capsys):
    r = tiny_recipe(data_dir, llama_dir, adapter={"type": "full"})
    Trainer(recipe_from_dict(r), run_dir=tmp_path / "full").run()
    assert main(["export", str(tmp_path / "full"), "--format", "peft"]) == 2
    assert "exports as fused" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "full"), "--format", "fused"]) == 0


def test_generate_with_the_shipped_model_reverses_a_word(capsys):
    from conftest import REPO

    assert (
        main(
            [
                "generate",
                "--model",
                str(REPO / "recipes" / "models" / "reverse-tiny"),
                "--raw",  # trained on completions, not through its chat template
                "reverse mlxtune =",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == "enutxlm"


def test_generate_from_a_run_an_adapter_and_a_scale(tmp_path, data_dir, llama_dir, capsys):
    from mlxtune.generate import eos_ids, generate_ids
    from mlxtune.runs.generation import load_for_generation

    tr = trained_run(tmp_path, data_dir, llama_dir, "lora", ["peft", "mlx-lm"])
    prompt = tr.train_set.examples[0].prompt_ids
    want = generate_ids(tr.model, [prompt], 8, eos_ids(tr.tokenizer))[0]
    base = generate_ids(load_model(llama_dir)[0], [prompt], 8, eos_ids(tr.tokenizer))[0]
    run = tmp_path / "lora"
    for model, adapter in (
        (run, None),
        (llama_dir, run / "export" / "peft"),
        (llama_dir, run / "export" / "mlx-lm"),
    ):
        m, tok = load_for_generation(model, adapter)
        assert generate_ids(m, [prompt], 8, eos_ids(tok))[0] == want, (model, adapter)
    m, tok = load_for_generation(llama_dir, run / "export" / "peft", scale=0.0)
    assert generate_ids(m, [prompt], 8, eos_ids(tok))[0] == base
    text = tr.tokenizer.decode(prompt[1:])
    assert main(["generate", "--model", str(run), "--max-tokens", "8", text]) == 0
    assert capsys.readouterr().out.strip() == tr.tokenizer.decode(want).strip()
    assert main(["generate", "--model", str(llama_dir), "--scale", "0.5", "x"]) == 2
    assert "--scale needs an adapter" in capsys.readouterr().err


def test_chat_streams_replies_through_the_chat_template(llama_dir):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxtune.cli",
            "chat",
            "--model",
            str(llama_dir),
            "--max-tokens",
            "4",
        ],
        input="hello\nhow are you\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") == 3  # two turns, then the empty line ends it


def test_adapter_settings_refuses_regex_targets(tmp_path):
    from mlxtune.export import adapter_settings

    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ".*proj"})
    )
    with pytest.raises(UserInputError, match="regular expression"):
        adapter_settings(tmp_path)


@pytest.mark.slow  # suite time: the default run stays under 10 minutes
def test_a_lora_run_over_a_quantized_base_exports_dequantized(
    tmp_path, data_dir, llama_dir, tokenizer, tokenizer_dir
):
    """QLoRA: LoRA over an 8-bit base; fused and GGUF exports come out dense."""
    import gguf
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_lm_load

    from mlxtune.models import save_model

    base, config = load_model(llama_dir)
    nn.quantize(base, group_size=32, bits=8)
    qdir, _ = save_model(
        base,
        {**config, "quantization": {"group_size": 32, "bits": 8}},
        tmp_path / "q8",
        tokenizer,
        tokenizer_dir,
    )
    r = tiny_recipe(
        data_dir, qdir, adapter={**ADAPTERS["lora"], "targets": ["all-linear"], "layers": None}
    )
    r["optimizer"] = {"lr": 5e-2}
    tr = Trainer(recipe_from_dict(r), run_dir=tmp_path / "qlora")
    assert isinstance(tr.model.layers[0].self_attn.q_proj.linear, nn.QuantizedLinear)
    tr.run()
    tr.model.eval()
    ids = tr.train_set.examples[0].ids
    want = logits(tr.model, ids)
    assert main(["export", str(tmp_path / "qlora"), "--format", "fused"]) == 0
    out = tmp_path / "qlora" / "export" / "fused"
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg
    weights = mx.load(str(out / "model.safetensors"))
    assert not any(k.endswith(".scales") for k in weights) and all(
        v.dtype == mx.float32 for v in weights.values()
    )
    fused, _ = mlx_lm_load(str(out))
    np.testing.assert_allclose(logits(fused, ids), want, rtol=1e-3, atol=1e-3)
    assert main(["export", str(tmp_path / "qlora"), "--format", "gguf", "--dtype", "f32"]) == 0
    from test_gguf import llama_cpp_forward, read

    f, t, r = read(next((tmp_path / "qlora" / "export" / "gguf").glob("*.gguf")))
    assert all(x.tensor_type == gguf.GGMLQuantizationType.F32 for x in r.tensors)
    np.testing.assert_allclose(llama_cpp_forward(f, t, ids), want[0], rtol=1e-3, atol=1e-3)


def test_fused_export_can_be_quantized_again(tmp_path, data_dir, llama_dir, capsys):
    import mlx.nn as nn
    from mlx_lm.utils import load as mlx_lm_load

    tr = trained_run(tmp_path, data_dir, llama_dir, "lora", [])
    ids = tr.train_set.examples[0].ids
    want = logits(tr.model, ids)
    out = tmp_path / "q8"
    assert (
        export_cli(
            str(tmp_path / "lora"),
            "--format",
            "fused",
            "--quantize",
            "8",
            "--q-group-size",
            "32",
            "--out",
            str(out),
        )
        == 0
    )
    assert json.loads((out / "config.json").read_text())["quantization"] == {
        "group_size": 32,
        "bits": 8,
    }
    model, _ = mlx_lm_load(str(out))
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert np.abs(logits(model, ids) - want).max() < 0.05 * np.abs(want).max()
    assert (
        export_cli(
            str(tmp_path / "lora"),
            "--format",
            "gguf",
            "--quantize",
            "8",
            "--out",
            str(tmp_path / "g"),
        )
        == 2
    )
    assert "--quantize applies to fused" in capsys.readouterr().err


def test_export_skips_a_damaged_checkpoint_and_refuses_a_named_one(
    tmp_path, data_dir, llama_dir, capsys
):
    r = tiny_recipe(data_dir, llama_dir, adapter=ADAPTERS["lora"])
    r["checkpoints"] = {"every": 2}
    run = tmp_path / "run"
    Trainer(recipe_from_dict(r), run_dir=run).run()
    ckpts = run / "checkpoints"
    with open(ckpts / "final" / "adapters.safetensors", "r+b") as f:  # a flipped byte
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    capsys.readouterr()
    assert export_cli(run, "--format", "mlx-lm", "--out", tmp_path / "out") == 0
    out = capsys.readouterr()
    assert "skipping" in out.err and "final" in out.err
    assert f"from {ckpts / 'best'}" in out.out  # the next in line: best, before the newest step
    assert export_cli(ckpts / "final", "--format", "mlx-lm", "--out", tmp_path / "o2") == 2
    err = capsys.readouterr().err
    assert "cannot read this checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "o2").exists()


def test_generate_answers_through_the_chat_template_unless_raw(capsys, monkeypatch):
    """The shipped model's tokenizer has a chat template: by default the prompt goes through it
    as a user's message (the ids transformers' tokenizer renders), --raw sends it as written,
    and an empty answer is said on stderr."""
    from transformers import AutoTokenizer

    import mlxtune.cli as cli
    from conftest import REPO

    model = REPO / "recipes" / "models" / "reverse-tiny"
    hf = AutoTokenizer.from_pretrained(str(model))
    seen = []
    monkeypatch.setattr(cli, "_stream", lambda m, tok, prompt, *a: seen.append(prompt) or "")
    assert main(["generate", "--model", str(model), "hello there"]) == 0
    want = hf.apply_chat_template(
        [{"role": "user", "content": "hello there"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert list(seen[0]) == list(want) and len(want) > len(hf.encode("hello there"))
    assert "empty completion" in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--raw", "hello there"]) == 0
    assert seen[1] == "hello there"
