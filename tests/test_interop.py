"""Exports loaded by the tools that consume them: PEFT over transformers, and llama.cpp.

These need packages mlxtune does not depend on (torch, peft, llama-cpp-python), so they are
skipped where those are not installed. To run them:
    pip install torch peft llama-cpp-python && python -m pytest tests/test_interop.py
"""

import mlx.core as mx
import numpy as np
import pytest
from test_export import export_cli, logits, trained_run


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_peft_loads_the_peft_export_over_the_base(tmp_path, data_dir, llama_dir, kind):
    torch = pytest.importorskip("torch", reason="needs torch (not an mlxtune dependency)")
    peft = pytest.importorskip("peft", reason="needs peft (not an mlxtune dependency)")
    from transformers import AutoModelForCausalLM

    tr = trained_run(tmp_path, data_dir, llama_dir, kind, ["peft"])
    ids = tr.train_set.examples[0].ids
    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / kind / "export" / "peft"))
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, logits(tr.model, ids)[0], rtol=1e-4, atol=1e-4)


def test_llama_cpp_runs_the_gguf_model_and_adapter(tmp_path, data_dir, llama_dir, tokenizer):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="needs llama-cpp-python (not an mlxtune dependency)"
    )
    from mlxtune.gguf_export import write_gguf_model
    from mlxtune.models import load_model

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
