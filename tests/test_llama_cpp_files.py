"""GGUF files as users download them: written by llama.cpp's own converter
(``convert_hf_to_gguf.py``) and quantized by llama.cpp (``llama_model_quantize``), with the real
vocabularies llama.cpp ships for its own tests (``models/ggml-vocab-*.gguf``).

Run with ``-m llama_cpp``: the converter, its ``gguf-py`` and the vocabularies come from the
llama-cpp-python source distribution matching the installed ``llama_cpp`` (``$LLAMA_CPP_SOURCE``
names its ``vendor/llama.cpp`` folder, or it is downloaded once into the test cache).

For each family llama.cpp and mlx-lm share, a small model at random (hidden size 256, so that
the K-quants' 256-wide blocks apply) is written in Hugging Face layout, converted to F32 and
quantized to Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K and IQ4_NL. mlxtune loads each file as a base and
its logits are held against llama.cpp's: for F32 on the same file, and for each quantized type
on llama.cpp's own de-quantization of it (``llama_model_quantize`` back to F32), since
llama.cpp's CPU dot products over quantized weights quantize the activations too (2-14% of the
largest logit on these random models, where mlxtune computes in full precision). For the llama
and Qwen layouts, mlxtune's reading is also held against a NumPy forward over the tensors as
llama.cpp's own ``gguf-py`` de-quantizes them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm_archs import tiny_config
from test_gguf_families import FAMILIES as FIXED

from mlxtune.models import family_classes, is_quantized, load_gguf, save_model
from mlxtune.models.configs import normalise_config

pytestmark = pytest.mark.llama_cpp

IDS = [1, 5, 9, 12, 7, 3, 30, 4, 8, 17, 2, 40, 11, 6]
TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25}
TOL = 2e-3  # of the largest logit: llama.cpp's F32 graph against MLX's (GELU tables, sums)
SIZES = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
}
# the vocabulary each family's files are converted with (llama.cpp's own test vocabularies);
# the rest take Qwen2's
VOCAB = {"llama": "llama-bpe", "phi3": "llama-spm", "gemma": "llama-spm", "gemma2": "llama-spm"}
# families whose converter reads a sentencepiece tokenizer.model
VOCAB.update(
    {n: "llama-spm" for n in ("ernie4_5", "ernie4_5_moe", "minicpm3", "nemotron", "internlm2")}
)


def _llama_cpp():
    return pytest.importorskip(
        "llama_cpp",
        reason="needs llama-cpp-python (compiles from source, about 13 minutes on 2 cores)",
    )


@pytest.fixture(scope="session")
def source() -> Path:
    """llama.cpp's source folder (vendor/llama.cpp of the llama-cpp-python sdist)."""
    llama_cpp = _llama_cpp()
    named = os.environ.get("LLAMA_CPP_SOURCE")
    if named:
        return Path(named)
    version = llama_cpp.__version__
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxtune-tests"
    root = cache / f"llama-cpp-python-{version}" / "vendor" / "llama.cpp"
    if not (root / "convert_hf_to_gguf.py").exists():
        cache.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(cache)],
            capture_output=True, text=True,
        )  # fmt: skip
        if got.returncode:
            pytest.skip(f"cannot download llama-cpp-python's sources: {got.stderr[-300:]}")
        with tarfile.open(next(cache.glob(f"llama_cpp_python-{version}.tar.gz"))) as tar:
            tar.extractall(cache, filter="data")
    return root


def vocabulary(source: Path, name: str, out: Path) -> Path:
    """A tokenizer folder of llama.cpp's test vocabulary ``name``, as mlxtune reads it; a
    sentencepiece one with its ``tokenizer.model`` too (``sentencepiece_model``)."""
    from mlxtune.gguf.tokenizer import write_tokenizer_from_gguf

    folder = out / f"vocab-{name}"
    if not folder.exists():
        path = source / "models" / f"ggml-vocab-{name}.gguf"
        write_tokenizer_from_gguf(path, folder)
        if name.endswith("-spm"):
            (folder / "tokenizer.model").write_bytes(sentencepiece_model(path))
    return folder


def sentencepiece_model(path: Path) -> bytes:
    """A sentencepiece BPE model holding a llama-type GGUF vocabulary (pieces, scores, types,
    byte fallback): what llama.cpp's converter reads for the sentencepiece families."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from mlxtune.gguf.file import open_gguf

    f = open_gguf(path).fields
    piece = pb.ModelProto.SentencePiece
    kinds = {1: piece.NORMAL, 2: piece.UNKNOWN, 3: piece.CONTROL, 4: piece.USER_DEFINED,
             5: piece.UNUSED, 6: piece.BYTE}  # fmt: skip
    m = pb.ModelProto()
    for token, score, kind in zip(
        f["tokenizer.ggml.tokens"],
        f["tokenizer.ggml.scores"],
        f["tokenizer.ggml.token_type"],
        strict=True,
    ):
        p = m.pieces.add()
        p.piece, p.score, p.type = str(token), float(score), kinds[int(kind)]
    t, n = m.trainer_spec, m.normalizer_spec
    t.model_type, t.byte_fallback = pb.TrainerSpec.BPE, True
    t.unk_id, t.bos_id, t.eos_id, t.pad_id = 0, 1, 2, -1
    n.name, n.add_dummy_prefix, n.escape_whitespaces = "identity", True, True
    n.remove_extra_whitespaces = False
    return m.SerializeToString()


def hf_model(name: str, tok_dir: Path, out: Path) -> Path:
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    mx.random.seed(4)
    cfg = tiny_config(name, len(tok._tokenizer))
    cfg.update({k: v for k, v in SIZES.items() if k in cfg or k == "head_dim"})
    if "block_dim" in cfg:  # LFM2's MLP width: the model's own, as in its published configs
        cfg["block_dim"] = cfg["hidden_size"]
    if "kv_lora_rank" in cfg:  # latent attention: as many kv heads as heads, as published
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    if name == "hunyuan_v1_dense":  # the converter asserts HunYuan's own RoPE: NTK alpha 1000
        cfg.update(  # over base 10000, heads of 128, a 32k context
            num_attention_heads=2, head_dim=128, rope_theta=10000.0,
            max_position_embeddings=32768,
            rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
        )  # fmt: skip
    if name == "phi":  # what llama.cpp's phi2 writes whatever the config: Phi-2's own shape
        n = cfg["num_attention_heads"]
        cfg.update(num_key_value_heads=n, intermediate_size=4 * cfg["hidden_size"])
    if "mamba_d_head" in cfg:  # Granite 4 hybrids: heads x head size = expand x hidden, as
        cfg.setdefault("mamba_expand", 2)  # their published configs (transformers checks it)
        cfg["mamba_d_head"] = cfg["mamba_expand"] * cfg["hidden_size"] // cfg["mamba_n_heads"]
    cfg.update(FIXED.get(name, {}))
    cfg.setdefault("max_position_embeddings", 4096)  # the converter reads it
    if name == "gemma2":  # the converter reads it (mlx-lm's Gemma 2 has no window; the rows
        cfg.setdefault("sliding_window", 4096)  # here are shorter than any)
    if name == "gemma3_text":
        cfg.update(head_dim=64, query_pre_attn_scalar=64)
    model_class, args_class = family_classes(cfg)
    model = model_class(args_class.from_dict(normalise_config(cfg, args_class)))
    params = tree_flatten(model.parameters())  # norms and biases away from 1 and 0
    model.load_weights([(k, v + 0.05 * mx.random.normal(v.shape)) for k, v in params])
    save_model(model, cfg, out, tok, tok_dir)
    return out


def convert(source: Path, folder: Path, out: Path) -> Path:
    """llama.cpp's converter on a Hugging Face folder: an F32 GGUF."""
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    cmd = [sys.executable, "convert_hf_to_gguf.py", str(folder), "--outfile", str(out)]
    got = subprocess.run(
        [*cmd, "--outtype", "f32"], cwd=source, env=env, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-2000:]
    return out


def quantize(src: Path, dst: Path, ftype: int) -> Path:
    """llama.cpp's quantizer: ``src`` to type ``ftype`` (0: F32, a quantized file de-quantized
    by llama.cpp itself)."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    return dst


def llama_cpp_logits(path: Path, lora: Path | None = None) -> np.ndarray:
    llama_cpp = _llama_cpp()
    f32 = 0  # the key/value cache in full precision, as mlxtune computes
    llm = llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=64, verbose=False, type_k=f32, type_v=f32,
        lora_path=str(lora) if lora else None,
    )  # fmt: skip
    llm.eval(IDS)
    return np.array(llm.scores[: len(IDS)])


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# families llama.cpp's converter and mlx-lm share, whose files mlxtune loads: the default
# llama_cpp run takes the first three; -m "llama_cpp and slow" all
REAL = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "gemma3_text",
    "gemma2",
    "phi3",
    "olmo2",
    "granite",
]
FAMILY = [n if i < 3 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(REAL)]
_MADE: dict[str, dict[str, Path]] = {}


def family_files(name: str, source: Path, factory) -> dict[str, Path]:
    """{type: GGUF file} of family ``name``: llama.cpp's converter's F32 file and its
    quantizations (made once a session)."""
    if name not in _MADE:
        out = factory.mktemp(f"llama-cpp-{name}")
        tok = vocabulary(source, VOCAB.get(name, "qwen2"), out)
        f32 = convert(source, hf_model(name, tok, out / "hf"), out / "F32.gguf")
        found = {"F32": f32}
        for kind, ftype in TYPES.items():
            found[kind] = quantize(f32, out / f"{kind}.gguf", ftype)
            found[f"{kind}-F32"] = quantize(found[kind], out / f"{kind}-F32.gguf", 0)
        _MADE[name] = found
    return _MADE[name]


@pytest.mark.parametrize("kind", ["F32", *TYPES])
@pytest.mark.parametrize("name", FAMILY)
def test_llama_cpps_own_file_loads_with_llama_cpps_logits(name, kind, source, tmp_path_factory):
    found = family_files(name, source, tmp_path_factory)
    model, config, _ = load_gguf(found[kind], "float32")
    got = np.array(model(mx.array([IDS]))[0])
    want = llama_cpp_logits(found[kind if kind == "F32" else f"{kind}-F32"])
    assert relative(got, want) < TOL, (name, kind)


# the other families llama.cpp's converter and mlx-lm share whose files mlxtune reads (the
# table of docs/models.md): each family's seven files made, read and dropped in one test
SURVEY = [
    "gemma", "starcoder2", "mixtral", "olmoe", "granitemoe", "exaone_moe", "afmoe", "lfm2_moe",
    "olmo3", "cohere", "exaone", "ministral3", "seed_oss", "smollm3", "stablelm", "mamba",
    "mamba2", "falcon_h1", "nemotron_h", "lfm2", "phi", "gpt2", "deepseek", "deepseek_v2",
    "deepseek_v3", "youtu_llm", "ernie4_5", "ernie4_5_moe", "nemotron", "minimax", "bailing_moe", "granitemoehybrid",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", SURVEY)
def test_each_shared_familys_llama_cpp_files_load_with_llama_cpps_logits(name, source, tmp_path):
    """llama.cpp's converter's F32 file of the family and its six quantizations: mlxtune's
    logits are llama.cpp's on each (on the F32 de-quantization of a quantized file)."""
    tok = vocabulary(source, VOCAB.get(name, "qwen2"), tmp_path)
    f32 = convert(source, hf_model(name, tok, tmp_path / "hf"), tmp_path / "F32.gguf")
    files = {"F32": (f32, f32)}
    for kind, ftype in TYPES.items():
        q = quantize(f32, tmp_path / f"{kind}.gguf", ftype)
        files[kind] = (q, quantize(q, tmp_path / f"{kind}-F32.gguf", 0))
    off = {}
    for kind, (path, reference) in files.items():
        model, _, _ = load_gguf(path, "float32")
        off[kind] = relative(np.array(model(mx.array([IDS]))[0]), llama_cpp_logits(reference))
    shutil.rmtree(tmp_path, ignore_errors=True)  # a family's files: about 1 GB
    print(name, {kind: f"{d:.1e}" for kind, d in off.items()})  # docs/models.md's table (-s)
    assert max(off.values()) < TOL, off


@pytest.mark.parametrize("kind", ["F32", *TYPES])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])  # the NumPy forward's layouts
def test_the_quantized_tensors_read_as_llama_cpps_gguf_py_reads_them(
    name, kind, source, tmp_path_factory
):
    """A NumPy forward over gguf-py's de-quantization (llama.cpp's own Python reader) of the
    same file: mlxtune's reading of every quant type, tightly."""
    from test_gguf import llama_cpp_forward, read

    found = family_files(name, source, tmp_path_factory)
    f, tensors, _ = read(found[kind])
    want = llama_cpp_forward(f, tensors, IDS)
    model, _, _ = load_gguf(found[kind], "float32")
    assert relative(np.array(model(mx.array([IDS]))[0]), want) < 1e-5


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", FAMILY)
def test_q8_0_and_q4_0_stay_quantized_for_qlora(name, kind, source, tmp_path_factory):
    """The types MLX can hold as codes load as QLoRA's quantized base (no de-quantization),
    giving the logits of the de-quantized reading."""
    found = family_files(name, source, tmp_path_factory)
    dense, _, _ = load_gguf(found[kind], "float32")
    held, _, _ = load_gguf(found[kind], "float32", keep_quantized=True)
    assert any(is_quantized(m) for _, m in held.named_modules())
    want = np.array(dense(mx.array([IDS]))[0])
    assert relative(np.array(held(mx.array([IDS]))[0]), want) < 1e-4


def test_a_run_over_a_q4_k_m_file_trains_and_its_adapter_applies_in_llama_cpp(
    source, tmp_path_factory, tmp_path
):
    from conftest import build_run, tiny_recipe, write_jsonl
    from mlxtune.cli import main

    found = family_files("llama", source, tmp_path_factory)
    rows = [{"text": f"the number {i} is written {i * 7 % 100} and {i * 3}"} for i in range(64)]
    write_jsonl(tmp_path / "data" / "train.jsonl", rows)
    write_jsonl(tmp_path / "data" / "valid.jsonl", rows[:8])
    r = tiny_recipe(
        tmp_path / "data", found["Q4_K_M"],
        adapter={"type": "lora", "rank": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]},
        optimizer={"lr": 2e-2}, export={"formats": ["gguf-adapter"]},
    )  # fmt: skip
    r["train"]["max_steps"] = 12
    trainer = build_run(r, tmp_path)
    summary = trainer.run()
    rows_out = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [x["loss"] for x in rows_out if "loss" in x]
    assert losses[-1] < losses[0] and summary["steps"] == 12
    adapter = next((tmp_path / "run" / "export" / "gguf-adapter").glob("*.gguf"))
    trainer.model.eval()
    ours = np.array(trainer.model(mx.array([IDS]))[0])
    base = llama_cpp_logits(found["Q4_K_M-F32"])  # the same weights, computed in F32
    theirs = llama_cpp_logits(found["Q4_K_M-F32"], adapter)
    assert relative(theirs, ours) < TOL
    assert relative(theirs, base) > 2 * relative(theirs, ours)  # the adapter is what moved it
    assert main(["export", str(tmp_path / "run"), "--format", "gguf", "--dtype", "q8_0"]) == 0


def test_each_vocabulary_tokenizes_as_llama_cpps_own_tests_say(source, tmp_path):
    """llama.cpp's tokenizer test vectors (``models/ggml-vocab-*.gguf.inp`` / ``.out``): the
    tokenizer mlxtune reads from each vocabulary file gives llama.cpp's ids for every text.
    A vocabulary mlxtune does not read is named with the reason."""
    from mlxtune.errors import UserInputError
    from mlxtune.tokenizer import load_tokenizer

    read, refused = [], {}
    for f in sorted((source / "models").glob("ggml-vocab-*.gguf")):
        inp, out = Path(f"{f}.inp"), Path(f"{f}.out")
        if not inp.exists():
            continue
        name = f.stem.removeprefix("ggml-vocab-")
        try:
            tok = load_tokenizer(vocabulary(source, name, tmp_path))
        except UserInputError as e:
            refused[name] = e.message
            continue
        texts = inp.read_text().split("\n__ggml_vocab_test__\n")
        wants = out.read_text().split("\n")
        for text, want in zip(texts, wants, strict=False):
            got = tok._tokenizer.encode(text, add_special_tokens=False)
            assert got == [int(x) for x in want.split()], (name, text)
        read.append(name)
    assert {"llama-bpe", "llama-spm", "qwen2", "phi-3", "gpt-2", "qwen35"} <= set(read)
    # what is not read says why: a tokenizer model or pre-tokenizer by its name
    assert all("not supported" in why for why in refused.values()), refused
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_saved_config_names_a_class_llama_cpps_converter_converts(source):
    """Every family mlxtune writes GGUF for saves a config.json whose ``architectures`` is a
    class llama.cpp's converter registers (the converter picks its code by that name alone),
    including families whose checkpoints run on their own code rather than transformers'."""
    import re

    from mlxtune.gguf.names import FAMILIES
    from mlxtune.models.common import hf_architecture

    code = [source / "convert_hf_to_gguf.py", *sorted((source / "conversion").glob("*.py"))]
    registered = set()
    for path in code:
        for args in re.findall(r"register\(([^)]*)\)", path.read_text()):
            registered.update(re.findall(r"\"([A-Za-z0-9_]+)\"", args))
    # text models mlx-lm builds only inside a multimodal wrapper, and Mistral 4 (published as
    # a multimodal checkpoint): their configs are the wrapper's
    inner = {"qwen2_vl_text", "qwen3_vl_text", "qwen3_vl_moe_text", "mistral4"}
    unknown = {mt: hf_architecture(mt) for mt in FAMILIES if mt not in inner}
    unknown = {mt: a for mt, a in unknown.items() if a not in registered}
    assert not unknown, unknown
