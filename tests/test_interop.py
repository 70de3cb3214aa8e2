"""Exports loaded by the tools that consume them: transformers (with PEFT for adapters), and
llama.cpp.

transformers computes the reference logits here, independently of mlxtune's MLX model. torch and
peft are not mlxtune dependencies: the `interop` extra brings them (pip install -e ".[interop]",
a CPU torch), CI installs it, and these tests run in the default suite. Without it they are
skipped, except under CI (CI set), where a missing torch or peft fails, so the checks cannot
silently stop running.

llama.cpp's check needs llama-cpp-python, which compiles from source (about 13 minutes on 2
cores): it carries the `llama_cpp` marker, left out of the default run. To run it:
    pip install llama-cpp-python && python -m pytest -m llama_cpp
"""

import importlib
import os

import mlx.core as mx
import numpy as np
import pytest
from test_export import export_cli, logits, trained_run

from mlxtune.models import load_model


def interop(name: str):
    """torch or peft, from the `interop` extra: skipped where it is not installed (failed there
    under CI, which installs it); an installed one that fails to import fails the test."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name or os.environ.get("CI"):
            raise
        pytest.skip(f"needs {name} (not an mlxtune dependency): pip install -e '.[interop]'")


def hf_logits(torch, model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def from_pretrained(torch, path):
    """transformers' AutoModelForCausalLM in float32, every weight read from the directory."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    # a weight missing from the file would be initialised at random, a stray one ignored
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_loads_the_peft_export_over_the_base(tmp_path, data_dir, llama_dir, kind):
    torch = interop("torch")
    peft = interop("peft")

    tr = trained_run(tmp_path, data_dir, llama_dir, kind, ["peft"])
    ids = tr.train_set.examples[0].ids
    want = logits(tr.model, ids)[0]
    base = from_pretrained(torch, llama_dir)
    # the adapter moved the logits, so an adapter PEFT ignored (B = 0) fails the check below
    assert np.abs(want - hf_logits(torch, base, ids)).max() > 1e-2
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / kind / "export" / "peft"))
    # fp32 on both sides: within 1e-5 (seen: 1.2e-7 on logits up to 0.6; the adapter moves them
    # by more than 1e-2)
    np.testing.assert_allclose(hf_logits(torch, model, ids), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_transformers_loads_the_fused_export(tmp_path, data_dir, llama_dir, kind):
    """The fused export of a trained adapter is a plain Hugging Face model: transformers reads it
    alone (no mlxtune, no PEFT) and computes mlxtune's logits."""
    torch = interop("torch")

    tr = trained_run(tmp_path, data_dir, llama_dir, kind, [])
    ids = tr.train_set.examples[0].ids
    want = logits(tr.model, ids)[0]
    # the adapter moved the logits, so a fused model that lost it fails the check below
    assert np.abs(want - logits(load_model(llama_dir)[0], ids)[0]).max() > 1e-2
    out = tmp_path / "fused"
    assert export_cli(tmp_path / kind, "--format", "fused", "--dtype", "float32", "--out", out) == 0
    got = hf_logits(torch, from_pretrained(torch, out), ids)
    # fp32 on both sides: within 1e-5 (seen: 1.2e-7 on logits up to 0.6; the adapter moves them
    # by more than 1e-2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.llama_cpp
def test_llama_cpp_runs_the_gguf_model_and_adapter(tmp_path, data_dir, llama_dir, tokenizer):
    llama_cpp = pytest.importorskip(
        "llama_cpp",
        reason="needs llama-cpp-python (not an mlxtune dependency; compiles from source, about "
        "13 minutes on 2 cores): pip install llama-cpp-python",
    )
    from mlxtune.export.gguf.write import write_gguf_model

    tr = trained_run(tmp_path, data_dir, llama_dir, "lora", ["gguf-adapter"])
    text = "reverse abc ="
    ids = list(tokenizer.encode(text))
    base_model, cfg = load_model(llama_dir)
    (tmp_path / "base").mkdir()
    base_gguf = write_gguf_model(base_model, cfg, tokenizer, llama_dir, tmp_path / "base", "f32")
    assert (
        export_cli(
            str(tmp_path / "lora"),
            "--format",
            "gguf",
            "--dtype",
            "f32",
            "--out",
            str(tmp_path / "fused"),
        )
        == 0
    )
    fused_gguf = next((tmp_path / "fused").glob("*.gguf"))
    adapter = tmp_path / "lora" / "export" / "gguf-adapter" / "adapter.gguf"

    def run(path, lora=None):
        llm = llama_cpp.Llama(
            model_path=str(path), lora_path=lora, logits_all=True, n_ctx=64, verbose=False
        )
        for sample in (text, "the quick brown fox", "  hello   there ", "unseen Q chars!", "ﬁ ab"):
            assert llm.tokenize(sample.encode(), add_bos=True) == list(tokenizer.encode(sample)), (
                sample
            )
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])

    want = logits(tr.model, ids)[0]
    base = np.array(base_model(mx.array([ids]))[0])
    assert np.abs(want - base).max() > 1e-2  # the adapter changed the model
    np.testing.assert_allclose(run(base_gguf), base, atol=2e-3)
    np.testing.assert_allclose(run(fused_gguf), want, atol=2e-3)
    np.testing.assert_allclose(run(base_gguf, str(adapter)), want, atol=2e-3)
