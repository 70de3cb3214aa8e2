"""A run whose base is a GGUF file: the tokenizer comes from the file, Q8_0 weights stay
quantized under LoRA (or are de-quantized when the recipe says so), the run resumes exactly, and
its exports load: fused in mlx-lm's layout, the GGUF adapter over the original file."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import yaml
from test_gguf import read
from test_resume import crashed, rows, trainer

from conftest import tiny_recipe
from mlxtune.cli import main
from mlxtune.export.gguf.write import write_gguf_model
from mlxtune.models import load_model
from mlxtune.runs.checkpoint import load_trained


@pytest.fixture
def gguf_base(tmp_path, llama_dir, tokenizer, tokenizer_dir):
    """The tiny llama as a Q8_0 GGUF file (its tokenizer in the metadata), and the model."""
    model, config = load_model(llama_dir)
    (tmp_path / "base").mkdir()
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path / "base", "q8_0")
    return path


def recipe(data_dir, path, **model):
    r = tiny_recipe(
        data_dir,
        None,
        adapter={"type": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        train={"batch_size": 8, "max_steps": 8, "log_every": 1, "progress": False, "seed": 3},
        eval={"every": 4},
        checkpoints={"every": 3, "keep_last": 5},
    )
    r["model"] = {"path": str(path), **model}
    r["optimizer"] = {"lr": 5e-2}
    return r


def test_lora_trains_over_the_quantized_file_and_resumes_exactly(
    tmp_path, data_dir, gguf_base, tokenizer
):
    r = recipe(data_dir, gguf_base)
    tr = trainer(r, tmp_path / "whole")
    tr.run()
    log = (tmp_path / "whole" / "log.txt").read_text()
    assert "tokenizer from the GGUF metadata: t5" in log
    assert "15 weights kept quantized (15 at 8 bits, groups of 32)" in log
    q = [m for _, m in tr.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(q) == 14 and isinstance(tr.model.model.embed_tokens, nn.QuantizedEmbedding)
    # the tokenizer read from the file encodes as the one the file was written from
    text = "reverse hello = olleh"
    assert list(tr.tokenizer.encode(text)) == list(tokenizer.encode(text))
    want = rows(tmp_path / "whole")
    losses = [row["loss"] for row in want if "loss" in row]
    assert len(losses) == 8 and losses[-1] < losses[0]
    crashed(r, tmp_path / "cut", at=5)
    trainer(r, tmp_path / "cut", resume="latest").run()
    assert rows(tmp_path / "cut") == want
    # the checkpoint alone rebuilds the model over the quantized base
    ids = tr.train_set.examples[0].ids
    tr.model.eval()
    np.testing.assert_allclose(
        np.array(load_trained(tmp_path / "whole").model(mx.array([ids]))),
        np.array(tr.model(mx.array([ids]))),
        atol=1e-5,
    )


def test_dequantize_trains_over_dense_weights(tmp_path, data_dir, gguf_base):
    tr = trainer(recipe(data_dir, gguf_base, dequantize=True), tmp_path / "dense")
    tr.run()
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in tr.model.named_modules())
    assert "15 de-quantized to float32 (15 Q8_0)" in (tmp_path / "dense" / "log.txt").read_text()


def test_exports_of_a_gguf_run_load(tmp_path, data_dir, gguf_base):
    r = recipe(data_dir, gguf_base)
    r["export"] = {"formats": ["gguf-adapter", "fused", "mlx-lm"]}
    tr = trainer(r, tmp_path / "run")
    tr.run()
    tr.model.eval()
    ids = tr.train_set.examples[0].ids
    want = np.array(tr.model(mx.array([ids]))[0])
    # fused: de-quantized, in the family's Hugging Face layout, with the GGUF's tokenizer
    fused = tmp_path / "run" / "export" / "fused"
    assert json.loads((fused / "config.json").read_text())["model_type"] == "llama"
    assert (fused / "tokenizer.json").exists()
    model, _ = load_model(fused)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(mx.array([ids]))[0]), want, atol=1e-4)
    # mlx-lm: the adapter, and the base it trained over (mlx-lm reads no GGUF) with the
    # file's Q8_0 codes in mlx-lm's quantized layout
    from mlx_lm.utils import load as mlx_lm_load

    mlx_dir = tmp_path / "run" / "export" / "mlx-lm"
    cfg = json.loads((mlx_dir / "base" / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    m, _ = mlx_lm_load(str(mlx_dir / "base"), adapter_path=str(mlx_dir))
    assert isinstance(m.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    np.testing.assert_allclose(np.array(m(mx.array([ids]))[0]), want, atol=1e-4)
    # the GGUF adapter over the original file: base + alpha/r * B @ A, llama.cpp's rule, gives
    # the trained q/v weights in the file's (permuted) layout
    _, base, _ = read(gguf_base)
    _, ad, _ = read(tmp_path / "run" / "export" / "gguf-adapter" / "adapter.gguf")
    out = tmp_path / "fz"
    assert (
        main(
            [
                "export",
                str(tmp_path / "run"),
                "--format",
                "gguf",
                "--dtype",
                "f32",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    gguf_out = next(out.glob("*.gguf"))
    assert gguf_out.name == f"{gguf_base.stem}-f32.gguf"
    _, fused_t, _ = read(gguf_out)
    for name in ("blk.0.attn_q.weight", "blk.1.attn_v.weight"):
        merged = base[name] + (8.0 / 4) * ad[name + ".lora_b"] @ ad[name + ".lora_a"]
        np.testing.assert_allclose(merged, fused_t[name], atol=1e-5)


def test_a_model_path_that_is_not_gguf_or_a_package_is_refused(tmp_path, data_dir, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file")
    for path, says in (
        (str(fake), "does not start with GGUF's magic"),
        ("package:no_such_package_here/m.gguf", "'no_such_package_here' is not installed"),
        ("package:mlxtune/../setup.gguf", "must be inside the package"),
    ):
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe(data_dir, path)))
        assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err


def test_generate_reads_a_gguf_file_like_the_directory_it_came_from(
    tmp_path, llama_dir, tokenizer, tokenizer_dir, capsys
):
    model, config = load_model(llama_dir)
    (tmp_path / "f32").mkdir()
    path = write_gguf_model(model, config, tokenizer, tokenizer_dir, tmp_path / "f32", "f32")
    outs = []
    for m in (llama_dir, path):
        assert main(["generate", "--model", str(m), "--max-tokens", "8", "reverse abc ="]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
