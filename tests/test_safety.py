"""What mlxtune never does with the files it is given: run code from YAML, unpickle weights,
import a model's or tokenizer's Python without the recipe asking, or write outside the folder
a run, an export or a checkpoint belongs in."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tiny_recipe
from mlxtune.cli import main
from mlxtune.errors import UserInputError


def snapshot(root: Path) -> dict:
    """Every file and folder under ``root``: a file as (bytes, mtime), a folder as 'dir'."""
    out = {}
    for p in sorted([root, *root.rglob("*")]):
        out[str(p)] = (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else "dir"
    return out


def write_recipe(path: Path, recipe: dict) -> str:
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


class _Touch:
    """Unpickling this creates the file ``path``: a pickle that runs code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker))


def assert_refused(capsys, argv, fragment) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    assert fragment in err, err
    return err


# ----------------------------------------------------------------------------- (a) YAML


TAG = '!!python/object/apply:os.system ["touch PWNED"]'


def test_a_python_tag_in_a_recipe_is_refused_and_runs_nothing(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(tiny_recipe(data_dir, llama_dir)) + f"extra: {TAG}\n"
    p = tmp_path / "r.yaml"
    p.write_text(text)
    for cmd in ("run", "validate"):
        assert_refused(capsys, [cmd, str(p)], "YAML does not parse")
    p.write_text(yaml.safe_dump(tiny_recipe(data_dir, llama_dir)))
    assert_refused(capsys, ["run", str(p), f"name={TAG}"], "is not valid YAML")
    assert not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "runs").exists()


# Calls that load code or pickles: (module or object name, attribute); None: a builtin.
FORBIDDEN_CALLS = {
    ("yaml", "load"),
    ("yaml", "load_all"),
    ("yaml", "unsafe_load"),
    ("yaml", "unsafe_load_all"),
    ("yaml", "full_load"),
    ("yaml", "full_load_all"),
    ("torch", "load"),
    (None, "eval"),
    (None, "exec"),
    (None, "compile"),
    (None, "__import__"),
}
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "marshal", "shelve", "torch"}
UNSAFE_LOADERS = {"Loader", "UnsafeLoader", "FullLoader"}


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """Where ``source`` loads YAML unsafely, unpickles, or runs code from data."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"{where}: import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and (None, f.id) in FORBIDDEN_CALLS:
                found.append(f"{where}: {f.id}(...)")
            if isinstance(f, ast.Attribute):
                owner = f.value.id if isinstance(f.value, ast.Name) else ""
                if (owner, f.attr) in FORBIDDEN_CALLS:
                    found.append(f"{where}: {owner}.{f.attr}(...)")
            for kw in node.keywords:
                v = kw.value
                if kw.arg == "allow_pickle" and not (
                    isinstance(v, ast.Constant) and v.value is False
                ):
                    found.append(f"{where}: allow_pickle=")
                if kw.arg == "trust_remote_code" and isinstance(v, ast.Constant) and v.value:
                    found.append(f"{where}: trust_remote_code=True")
                name = v.attr if isinstance(v, ast.Attribute) else getattr(v, "id", None)
                if kw.arg == "Loader" and name in UNSAFE_LOADERS:
                    found.append(f"{where}: Loader={name}")
    return found


def test_the_source_scan_finds_what_it_looks_for():
    bad = """
import pickle
from dill import loads
import numpy as np, yaml, torch
yaml.load(text)
yaml.unsafe_load(text)
yaml.load(text, Loader=yaml.FullLoader)
np.load(path, allow_pickle=True)
torch.load(path)
eval(line)
exec(code)
AutoTokenizer.from_pretrained(p, trust_remote_code=True)
"""
    assert len(unsafe_calls(bad)) == 12, unsafe_calls(bad)
    fine = """
import yaml, re, mlx.core as mx
yaml.safe_load(text)
yaml.compose(text, Loader=yaml.SafeLoader)
mx.compile(f)
re.compile("x")
np.load(path)
model.eval()
self.model.eval()
"""
    assert unsafe_calls(fine) == []


def test_the_package_never_loads_yaml_unsafely_unpickles_or_evals():
    files = [
        p
        for folder in ("mlxtune", "tui", "metal_kernels")
        for p in sorted((REPO / folder).rglob("*.py"))
    ]
    assert len(files) > 20 and REPO / "mlxtune" / "config" / "load.py" in files
    found = [hit for p in files for hit in unsafe_calls(p.read_text(), str(p.relative_to(REPO)))]
    assert found == []


# ------------------------------------------------------------------ (b) safetensors only


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_a_model_with_only_pickled_weights_is_refused(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys, weights
):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "UNPICKLED"
    m = tmp_path / "pickled-model"
    m.mkdir()
    shutil.copy(llama_dir / "config.json", m / "config.json")
    (m / weights).write_bytes(evil_pickle(marker))
    suffix = Path(weights).suffix
    need = f"no model*.safetensors weights in the model directory (pickled {suffix} weights"
    assert_refused(capsys, ["generate", "--model", str(m), "hello"], need)
    p = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_dir, m))
    err = assert_refused(capsys, ["run", p], need)
    assert "convert them to safetensors" in err
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", ["adapter.bin", "adapters.pt", "adapter.pkl"])
def test_a_pickled_adapter_is_refused(
    tmp_path, data_dir, llama_dir, tokenizer, monkeypatch, capsys, name
):
    from mlxtune.adapters import apply_adapters
    from mlxtune.export import import_adapter
    from mlxtune.models import load_model

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "UNPICKLED"
    file = tmp_path / name
    file.write_bytes(evil_pickle(marker))
    folder = tmp_path / "adapter-dir"  # an mlx-lm adapter folder whose weights are a pickle
    folder.mkdir()
    (folder / Path(name).with_stem("adapters").name).write_bytes(evil_pickle(marker))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": 2,
                "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": ["q_proj"]},
            }
        )
    )
    for init_from, fragment in ((file, "pickled weights are never loaded"), (folder, "pickled")):
        adapter = {"type": "lora", "rank": 4, "alpha": 8, "init_from": str(init_from)}
        p = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_dir, llama_dir, adapter=adapter))
        err = assert_refused(capsys, ["run", p], fragment)
        assert "safetensors" in err
    err = assert_refused(
        capsys, ["generate", "--model", str(llama_dir), "--adapter", str(folder), "hi"], "pickled"
    )
    assert "adapters.safetensors or adapter_model.safetensors" in err
    assert main(["generate", "--model", str(llama_dir), "--adapter", str(file), "hi"]) == 2
    model, _ = load_model(llama_dir)
    apply_adapters(model, "lora", 4, 8.0, 0.0, ["q_proj"])
    for path in (file, folder):
        with pytest.raises(UserInputError, match="safetensors"):
            import_adapter(model, path)
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------- (c) remote code

EVIL = (
    "from pathlib import Path\n"
    "Path({marker!r}).write_text('ran')\n"
    "from mlx_lm.models.llama import Model, ModelArgs  # noqa\n"
)


def model_with_code(src: Path, dst: Path, marker: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "evil.py").write_text(EVIL.format(marker=str(marker)))
    return dst


REMOTE = {
    "model_file": {"model_file": "evil.py"},
    "auto_map": {
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    },
}


@pytest.mark.parametrize("config", REMOTE.values(), ids=REMOTE.keys())
def test_a_model_that_ships_code_is_refused_unless_the_recipe_trusts_it(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys, config
):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "CODE_RAN"
    m = model_with_code(llama_dir, tmp_path / "coded-model", marker, **config)
    p = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_dir, m))
    err = assert_refused(capsys, ["run", p], "asks to run its own Python code (evil.py)")
    assert "model.trust_remote_code: true" in err and "config.json" in err
    assert_refused(capsys, ["generate", "--model", str(m), "hi"], "evil.py")
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


def test_trust_remote_code_is_the_switch(tmp_path, data_dir, llama_dir, monkeypatch, capsys):
    """The same model_file runs once the recipe asks for it: the refusal above is the flag's
    doing, and the marker would show the code running."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "CODE_RAN"
    m = model_with_code(llama_dir, tmp_path / "coded-model", marker, model_file="evil.py")
    model = {"path": str(m), "trust_remote_code": True}
    p = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_dir, model=model))
    assert main(["run", p, "--dry-run"]) == 0, capsys.readouterr().err
    assert marker.read_text() == "ran"


def test_a_run_that_trusted_the_model_s_code_exports_with_it(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys
):
    """export reloads the base as the run's recipe allowed: trusted there, trusted here."""
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "CODE_RAN"
    m = model_with_code(llama_dir, tmp_path / "coded-model", marker, model_file="evil.py")
    model = {"path": str(m), "trust_remote_code": True}
    r = tiny_recipe(data_dir, model=model, train={"batch_size": 8, "max_steps": 1})
    p = write_recipe(tmp_path / "r.yaml", r)
    assert main(["run", p, "--run-dir", "run"]) == 0, capsys.readouterr().err
    marker.unlink()
    assert main(["export", "run", "--format", "mlx-lm", "--out", "out"]) == 0, (
        capsys.readouterr().err
    )
    assert (tmp_path / "out" / "adapters.safetensors").exists() and marker.exists()


def test_a_tokenizer_that_ships_code_is_refused(tmp_path, data_dir, llama_dir, monkeypatch, capsys):
    from mlxtune.tokenizer import load_tokenizer

    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "CODE_RAN"
    m = tmp_path / "coded-tokenizer"
    shutil.copytree(llama_dir, m)
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"
    cfg["auto_map"] = {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    (m / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    p = write_recipe(tmp_path / "r.yaml", tiny_recipe(data_dir, m))
    err = assert_refused(capsys, ["run", p], "asks to run its own Python code (evil_tok.py)")
    assert "tokenizer_config.json" in err and "model.trust_remote_code: true" in err
    with pytest.raises(UserInputError, match="evil_tok.py"):
        load_tokenizer(m)
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------- (d) nothing written outside


def test_a_run_name_or_recipe_run_dir_cannot_leave_its_folder(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys
):
    work = tmp_path / "work" / "deep"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    cases = [
        ({"name": "../../escape"}, "name: '../../escape' is not a plain name"),
        ({"name": "..\\escape"}, "is not a plain name"),
        ({"name": ".."}, "is not a plain name"),
        ({"run_dir": "../../escape"}, "run_dir: '../../escape' is not a folder under"),
        ({"run_dir": str(tmp_path / "abs-escape")}, "is not a folder under the current directory"),
    ]
    before = snapshot(tmp_path)
    for change, fragment in cases:
        p = write_recipe(tmp_path / "r.yaml", {**tiny_recipe(data_dir, llama_dir), **change})
        before[str(tmp_path / "r.yaml")] = snapshot(tmp_path)[str(tmp_path / "r.yaml")]
        for argv in (["run", p], ["run", p, "--tui"], ["validate", p]):
            err = assert_refused(capsys, argv, fragment)
            assert "r.yaml" in err
        assert snapshot(tmp_path) == before, change


def test_run_name_api_refuses_paths():
    from mlxtune.runs.rundir import default_run_dir

    assert default_run_dir("my run").parent == Path("runs")
    for name in ("../x", "a/b", "/abs", "..", "a\\b"):
        with pytest.raises(UserInputError, match="not a plain name"):
            default_run_dir(name)


def _trained_run(tmp_path, data_dir, llama_dir) -> Path:
    from mlxtune import Trainer, recipe_from_dict
    from mlxtune.console import Console

    r = tiny_recipe(data_dir, llama_dir, eval={"every": None, "max_batches": 1})
    r["train"]["max_steps"] = 2
    r["checkpoints"] = {"every": 1}
    run = tmp_path / "run"
    Trainer(recipe_from_dict(r), run_dir=run, console=Console(quiet=True)).run()
    return run


def test_resume_names_only_the_runs_own_checkpoints(tmp_path, data_dir, llama_dir, capsys):
    from mlxtune.runs.checkpoint import write_checksums

    run = _trained_run(tmp_path, data_dir, llama_dir)
    # an intact-looking checkpoint beside checkpoints/, and another run's
    for fake in (run / "x", tmp_path / "other" / "checkpoints" / "step-000001"):
        shutil.copytree(run / "checkpoints" / "step-000001", fake)
        write_checksums(fake)
    p = write_recipe(
        tmp_path / "r.yaml",
        {
            **tiny_recipe(data_dir, llama_dir, eval={"every": None, "max_batches": 1}),
            "checkpoints": {"every": 1},
        },
    )
    before = snapshot(tmp_path)
    for which in ("../x", str(run / "x"), str(tmp_path / "other/checkpoints/step-000001")):
        argv = ["run", p, "--run-dir", str(run), "--resume", which]
        assert_refused(capsys, argv, "not one of this run's checkpoints")
        assert snapshot(tmp_path) == before, which
    from mlxtune.runs.checkpoint import pick

    with pytest.raises(UserInputError, match="not one of this run's checkpoints"):
        pick(run, "../x", print)
    assert pick(run, "step-000002", print) == run / "checkpoints" / "step-000002"
    assert pick(run, str(run / "checkpoints" / "final"), print).name == "final"


def test_export_writes_only_inside_out(tmp_path, data_dir, llama_dir, capsys):
    run = _trained_run(tmp_path, data_dir, llama_dir)
    aside = tmp_path / "exports" / ".adapter.tmp"  # the user's folder, named like a temporary
    aside.mkdir(parents=True)
    (aside / "keep.txt").write_text("mine")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out, fragment in (
        (full, "already exists and is not empty"),
        (run / "checkpoints" / "final" / "out", "inside the run's checkpoints"),
        (run / "checkpoints", "already exists and is not empty"),
        (run, "already exists and is not empty"),
    ):
        argv = ["export", str(run), "--format", "mlx-lm", "--out", str(out)]
        assert_refused(capsys, argv, fragment)
        assert snapshot(tmp_path) == before, out
    out = tmp_path / "exports" / "adapter"
    assert main(["export", str(run), "--format", "mlx-lm", "--out", str(out)]) == 0
    after = snapshot(tmp_path)
    new = set(after) - set(before)
    assert new and all(p == str(out) or p.startswith(str(out) + "/") for p in new), new
    assert {k: after.get(k) for k in before} == before  # nothing else changed or went away
    assert (out / "adapters.safetensors").exists() and (aside / "keep.txt").read_text() == "mine"


ESCAPES = [
    ("..", "x"),
    ("../x",),
    ("checkpoints", "..", "..", "x"),
    ("a\0b",),
]


@pytest.mark.parametrize("parts", ESCAPES, ids=["dotdot", "dotdot-slash", "deep", "nul"])
def test_run_dir_api_refuses_paths_outside(tmp_path, parts):
    from mlxtune.runs.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (tmp_path / "run" / "link").symlink_to(outside)
    before = snapshot(tmp_path)
    cases = [parts, (str(tmp_path / "abs.txt"),), ("link", "f")]
    for p in cases:
        with pytest.raises(UserInputError):
            rd.inside(*p)
        with pytest.raises(UserInputError):
            rd.write_text("/".join(p), "x")
        with pytest.raises(UserInputError):
            rd.write_json("/".join(p), {"a": 1})
        with pytest.raises(UserInputError):
            rd.append_jsonl("/".join(p), {"a": 1})
        with pytest.raises(UserInputError):
            with rd.staged(*p) as d:
                (d / "f").write_text("x")
        assert snapshot(tmp_path) == before, p


def test_run_dir_api_never_replaces_the_run_dir_itself(tmp_path):
    from mlxtune.runs.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    rd.write_text("metrics.jsonl", "{}\n")
    before = snapshot(tmp_path)
    assert rd.inside() == (tmp_path / "run").resolve()  # reading the folder is fine
    for parts in ((), (".",), ("checkpoints", "..")):
        with pytest.raises(UserInputError, match="the run directory itself"):
            with rd.staged(*parts) as d:
                (d / "f").write_text("x")
        with pytest.raises(UserInputError, match="the run directory itself"):
            rd.write_text("/".join(parts) or ".", "x")
        with pytest.raises(UserInputError, match="the run directory itself"):
            rd.append_jsonl("/".join(parts) or ".", {"a": 1})
        assert snapshot(tmp_path) == before, parts
    with rd.staged("checkpoints", "step-000001") as d:  # the normal case still works
        (d / "a.txt").write_text("ok")
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "a.txt").read_text() == "ok"


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    from mlxtune.runs import rundir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20261122-101500")
    first = rundir.default_run_dir("demo")
    first.mkdir(parents=True)
    second = rundir.default_run_dir("demo")
    assert (first.name, second.name) == ("demo-20261122-101500", "demo-20261122-101500-2")


def test_staged_folders_replace_whole_or_not_at_all(tmp_path):
    from mlxtune.runs.rundir import staged_folder

    final = tmp_path / "export" / "fmt"
    with staged_folder(final) as tmp:
        (tmp / "a.txt").write_text("one")
    assert (final / "a.txt").read_text() == "one"
    with pytest.raises(RuntimeError), staged_folder(final) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("crash while writing")
    assert (final / "a.txt").read_text() == "one"  # the good folder stays
    assert sorted(p.name for p in final.parent.iterdir()) == ["fmt"]  # nothing left beside it
    final.rename(final.with_name(".fmt.old"))  # a crash between the two renames
    with staged_folder(final) as tmp:
        assert (final / "a.txt").read_text() == "one"  # put back before anything else
        (tmp / "a.txt").write_text("two")
    assert (final / "a.txt").read_text() == "two"
    assert sorted(p.name for p in final.parent.iterdir()) == ["fmt"]
