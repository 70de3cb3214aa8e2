"""Malformed input through the real command line. Every case must: exit with 2; print one
`mlxtune: error:` line naming the file (and line) or the recipe key; print no traceback; and
leave everything already on disk as it was (bytes and mtimes), with no new run directory."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
import yaml

from conftest import tiny_arch, tiny_recipe, write_jsonl
from mlxtune.cli import main


def snapshot(*roots: Path) -> dict:
    """Every file and folder under ``roots``: a file as (bytes, mtime), a folder as 'dir'."""
    out = {}
    for root in roots:
        for p in sorted([root, *root.rglob("*")]):
            if p.is_file():
                out[str(p)] = (p.read_bytes(), p.stat().st_mtime_ns)
            else:
                out[str(p)] = "dir"
    return out


class World:
    """tmp_path as the current directory, with a finished run (metrics, a checkpoint, an export)
    already in runs/, a recipe r.yaml and its data in data/."""

    def __init__(self, tmp: Path, data: Path, model: Path):
        self.tmp, self.data, self.model = tmp, data, model
        self.old = tmp / "runs" / "old-run"
        ckpt = self.old / "checkpoints" / "step-000002"
        ckpt.mkdir(parents=True)
        (ckpt / "adapters.safetensors").write_bytes(b"old weights")
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2}))
        (self.old / "export" / "mlx-lm").mkdir(parents=True)
        (self.old / "export" / "mlx-lm" / "adapters.safetensors").write_bytes(b"old export")
        (self.old / "metrics.jsonl").write_text('{"step": 2, "loss": 1.5}\n')
        (self.old / "config_resolved.json").write_text(
            json.dumps({"recipe": {"name": "other"}, "recipe_file": "other.yaml"})
        )
        (self.old / "log.txt").write_text("old log\n")
        self.recipe = tmp / "r.yaml"
        self.fresh = tmp / "new-run"  # --run-dir for the cases: it must not appear

    def write_recipe(self, **sections) -> str:
        self.recipe.write_text(yaml.safe_dump(tiny_recipe(self.data, self.model, **sections)))
        return str(self.recipe)

    def data_section(self, **changes) -> dict:
        d = {
            "train": str(self.data / "train.jsonl"),
            "valid": str(self.data / "valid.jsonl"),
            "max_length": 48,
        }
        d.update(changes)
        return d

    def run(self, *extra) -> list[str]:
        return ["run", str(self.recipe), *extra, "--run-dir", str(self.fresh)]


def _recipe_text(w: World, text: str) -> list[str]:
    w.recipe.write_text(text)
    return w.run()


GOOD_HEAD = "name: t\nmodel:\n  path: {model}\ndata:\n  train: data/train.jsonl\n"


def yaml_does_not_parse(w):
    return _recipe_text(w, "name: t\nmodel:\n  path: [unclosed\ntrain:\n  max_steps: 3\n")


def unknown_key(w):
    return _recipe_text(
        w, GOOD_HEAD.format(model=w.model) + "train:\n  max_steps: 3\n  bach_size: 4\n"
    )


def key_given_twice(w):
    return _recipe_text(
        w, GOOD_HEAD.format(model=w.model) + "train:\n  max_steps: 3\n  max_steps: 30\n"
    )


def wrong_type(w):
    return _recipe_text(w, GOOD_HEAD.format(model=w.model) + "train:\n  max_steps: ten\n")


def out_of_range(w):
    return _recipe_text(
        w,
        GOOD_HEAD.format(model=w.model) + "adapter:\n  dropout: 1.5\ntrain:\n  max_steps: 3\n",
    )


def missing_data_file(w):
    w.write_recipe(data=w.data_section(train=str(w.data / "missing.jsonl")))
    return w.run()


def empty_dataset(w):
    (w.data / "empty.jsonl").write_text("\n\n")
    w.write_recipe(data=w.data_section(train=str(w.data / "empty.jsonl")))
    return w.run()


def line_not_json(w):
    good = json.dumps({"prompt": "reverse abc =", "completion": " cba"})
    (w.data / "bad.jsonl").write_text(f"{good}\n{good}\n{{'prompt': 'single quotes'}}\n{good}\n")
    w.write_recipe(data=w.data_section(train=str(w.data / "bad.jsonl")))
    return w.run()


def line_not_json_with_dashboard(w):
    return [*line_not_json(w), "--tui"]  # refused before the dashboard opens


def missing_fields(w):
    write_jsonl(
        w.data / "fields.jsonl",
        [{"prompt": "reverse abc =", "completion": " cba"}, {"prompt": "reverse xyz ="}],
    )
    w.write_recipe(data=w.data_section(train=str(w.data / "fields.jsonl")))
    return w.run()


def not_utf8(w):
    good = json.dumps({"prompt": "reverse abc =", "completion": " cba"}).encode()
    bad = b'{"prompt": "reverse \xff\xfe =", "completion": " x"}'
    (w.data / "latin.jsonl").write_bytes(good + b"\n" + bad + b"\n")
    w.write_recipe(data=w.data_section(train=str(w.data / "latin.jsonl")))
    return w.run()


def every_example_too_long(w):
    w.write_recipe(data=w.data_section(max_length=4, overlong="drop"))
    return w.run()


def exact_match_on_text_data(w):
    write_jsonl(w.data / "text.jsonl", [{"text": f"hello there {i}"} for i in range(20)])
    w.write_recipe(
        data=w.data_section(train=str(w.data / "text.jsonl"), valid=None),
        eval={"exact_match": 4},
    )
    return w.run()


def packed_rows_too_short(w):
    w.write_recipe(data=w.data_section(packing="stream", pack_length=1))
    return w.run()


def over_the_memory_limit(w):
    w.write_recipe(memory={"limit_gb": 1e-6})
    return w.run()


def chat_without_assistant(w):
    write_jsonl(
        w.data / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "hi"}]}],
    )
    w.write_recipe(data=w.data_section(train=str(w.data / "chat.jsonl")))
    return w.run()


def model_without_weights(w):
    m = w.tmp / "no-weights"
    shutil.copytree(w.model, m, ignore=shutil.ignore_patterns("*.safetensors"))
    w.write_recipe(model={"path": str(m)})
    return w.run()


def model_weights_truncated(w):
    m = w.tmp / "truncated"
    shutil.copytree(w.model, m)
    for f in m.glob("*.safetensors"):  # an interrupted download
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    w.write_recipe(model={"path": str(m)})
    return w.run()


def model_config_mistyped(w):
    m = w.tmp / "mistyped"
    shutil.copytree(w.model, m)
    config = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**config, "hidden_size": "big"}))
    w.write_recipe(model={"path": str(m)})
    return w.run()


def _init_from(w, config: str, weights: bytes) -> list[str]:
    a = w.tmp / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(config)
    (a / "adapters.safetensors").write_bytes(weights)
    lora = {"type": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj"], "init_from": str(a)}
    w.write_recipe(adapter=lora)
    return w.run()


MLX_LM_CONFIG = json.dumps(
    {"num_layers": 2, "lora_parameters": {"rank": 4, "scale": 2.0, "keys": ["self_attn.q_proj"]}}
)


def init_from_weights_damaged(w):
    return _init_from(w, MLX_LM_CONFIG, b"not safetensors")


def adapter_config_not_an_object(w):
    _init_from(w, "[4]", b"")
    return ["generate", "--model", str(w.model), "--adapter", str(w.tmp / "adapter"), "x"]


def tokenizer_bigger_than_model(w):
    from mlxtune.models import build_model, save_model
    from mlxtune.tokenizer import load_tokenizer

    tok = load_tokenizer(w.model)
    model, config = build_model(tiny_arch("llama", vocab_size=8), 8)
    small, _ = save_model(model, config, w.tmp / "small-model", tok, w.model)
    w.write_recipe(model={"path": str(small)})
    return w.run()


def run_dir_of_another_recipe(w):
    w.write_recipe()
    return ["run", str(w.recipe), "--run-dir", str(w.old)]


def override_without_equals(w):
    w.write_recipe()
    return w.run("train.batch_size")


def override_unknown_key(w):
    w.write_recipe()
    return w.run("train.bach_size=4")


def override_unknown_section(w):
    w.write_recipe()
    return w.run("trian.max_steps=4")


def override_value_not_yaml(w):
    w.write_recipe()
    return w.run("adapter.targets=[q_proj,")


def export_not_a_run(w):
    return ["export", str(w.data), "--format", "mlx-lm"]


def export_dtype_of_an_adapter(w):
    return ["export", str(w.old), "--format", "peft", "--dtype", "float16"]


def export_group_size_without_quantize(w):
    return ["export", str(w.old), "--format", "fused", "--q-group-size", "32"]


def export_over_a_full_folder(w):
    from mlxtune.runs.checkpoint import write_checksums

    final = w.old / "checkpoints" / "final"  # an intact checkpoint: the --out check refuses
    final.mkdir()
    (final / "trainer_state.json").write_text("{}")
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        mx.save_safetensors(str(final / name), {"w": mx.zeros(2)})
    write_checksums(final)
    return ["export", str(w.old), "--format", "mlx-lm"]  # export/mlx-lm holds files


CASES = [
    ("yaml-does-not-parse", yaml_does_not_parse, r"r\.yaml:\d+: YAML does not parse"),
    (
        "unknown-key",
        unknown_key,
        r"r\.yaml:8: train\.bach_size: unknown key; did you mean 'batch_size'\?",
    ),
    (
        "key-given-twice",
        key_given_twice,
        r"r\.yaml:8: train\.max_steps: given twice \(first on line 7\)",
    ),
    ("wrong-type", wrong_type, r"r\.yaml:7: train\.max_steps: expected an integer, got 'ten'"),
    ("out-of-range", out_of_range, r"r\.yaml:7: adapter\.dropout: must be in \[0\.0, 1\.0\)"),
    ("missing-data-file", missing_data_file, r"data/missing\.jsonl: data file not found"),
    ("empty-dataset", empty_dataset, r"data/empty\.jsonl: the data file has no examples"),
    ("line-not-json", line_not_json, r"data/bad\.jsonl:3: not valid JSON"),
    ("line-not-json-tui", line_not_json_with_dashboard, r"data/bad\.jsonl:3: not valid JSON"),
    ("missing-fields", missing_fields, r"data/fields\.jsonl:2: missing field 'completion'"),
    ("not-utf8", not_utf8, r"data/latin\.jsonl:2: not UTF-8"),
    (
        "every-example-too-long",
        every_example_too_long,
        r"data/train\.jsonl: no example is left to train on .*96 dropped too long.*data\.max_length",
    ),
    (
        "chat-without-assistant",
        chat_without_assistant,
        r"data/chat\.jsonl:1: the conversation has no assistant turn",
    ),
    (
        "exact-match-on-text-data",
        exact_match_on_text_data,
        r"eval\.exact_match: eval\.exact_match needs completion, instruction or chat data",
    ),
    (
        "packed-rows-too-short",
        packed_rows_too_short,
        r"r\.yaml:\d+: data\.pack_length: a row needs at least 2 tokens, got 1",
    ),
    (
        "over-the-memory-limit",
        over_the_memory_limit,
        r"r\.yaml: this run needs about .* GB at its peak, more than the 0\.00 GB of "
        r"memory\.limit_gb",
    ),
    (
        "model-without-weights",
        model_without_weights,
        r"no-weights: no model\*\.safetensors weights in the model directory",
    ),
    (
        "model-weights-truncated",
        model_weights_truncated,
        r"truncated: cannot read the weights: .*exceeding the size of the file",
    ),
    (
        "model-config-mistyped",
        model_config_mistyped,
        r"mistyped: cannot load the tokenizer: .*'hidden_size' expected int, got str",
    ),
    (
        "init-from-weights-damaged",
        init_from_weights_damaged,
        r"adapter/adapters\.safetensors: cannot read the weights: .*Invalid json header",
    ),
    (
        "adapter-config-not-an-object",
        adapter_config_not_an_object,
        r"/adapter: adapter_config\.json is not a JSON object",
    ),
    (
        "tokenizer-bigger-than-model",
        tokenizer_bigger_than_model,
        r"tokenizer: the tokenizer \(.*small-model\) has \d+ tokens but the model's "
        r"vocabulary \(.*small-model\) is 8",
    ),
    (
        "run-dir-of-another-recipe",
        run_dir_of_another_recipe,
        r"runs/old-run: this run directory already holds a run \(recipe 'other' from "
        r"other\.yaml\); continue it with --resume .*or choose a new --run-dir",
    ),
    ("override-without-equals", override_without_equals, r"override: expected key\.sub=value"),
    (
        "override-unknown-key",
        override_unknown_key,
        r"override 'train\.bach_size=4': train\.bach_size: unknown key; did you mean 'batch_size'",
    ),
    (
        "override-unknown-section",
        override_unknown_section,
        r"override 'trian\.max_steps=4': trian: unknown key; did you mean 'train'",
    ),
    (
        "override-value-not-yaml",
        override_value_not_yaml,
        r"override: value of 'adapter\.targets=\[q_proj,' is not valid YAML: expected the node "
        r"content, but found '<stream end>'$",
    ),
    (
        "export-not-a-run",
        export_not_a_run,
        r"/data: not a run directory or checkpoint \(no trainer_state\.json found\)",
    ),
    (
        "export-dtype-of-an-adapter",
        export_dtype_of_an_adapter,
        r"export: --dtype applies to fused and gguf exports, not peft",
    ),
    (
        "export-group-size-without-quantize",
        export_group_size_without_quantize,
        r"export: --q-group-size applies with --quantize",
    ),
    (
        "export-over-a-full-folder",
        export_over_a_full_folder,
        r"export/mlx-lm: already exists and is not empty; choose another --out",
    ),
]


@pytest.mark.parametrize("build, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(
    tmp_path, data_dir, llama_dir, monkeypatch, capsys, build, expected
):
    monkeypatch.chdir(tmp_path)
    w = World(tmp_path, data_dir, llama_dir)
    argv = build(w)
    before = snapshot(tmp_path, llama_dir)

    code = main(argv)

    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    errors = [line for line in (out + err).splitlines() if "error" in line.lower()]
    assert len(errors) == 1, out + err
    assert errors[0] == err.strip().splitlines()[-1]  # the last thing printed
    assert errors[0].startswith("mlxtune: error: ")
    assert re.search(expected, errors[0]), errors[0]
    assert out == ""  # nothing on stdout: a refused command produced nothing
    after = snapshot(tmp_path, llama_dir)
    assert after == before  # no file changed, none appeared or vanished
    assert not w.fresh.exists()


def test_a_pre_existing_empty_run_dir_is_left_empty_by_refused_input(
    tmp_path, data_dir, llama_dir, capsys
):
    """A folder the user made for the run keeps nothing from a run refused at the data."""
    w = World(tmp_path, data_dir, llama_dir)
    line_not_json(w)
    w.fresh.mkdir()
    assert main(w.run()) == 2
    assert "bad.jsonl:3" in capsys.readouterr().err
    assert list(w.fresh.iterdir()) == []


def test_a_crashed_run_without_metrics_still_holds_a_run(tmp_path, data_dir, llama_dir, capsys):
    """A run that stopped before its first metrics row (config and a checkpoint, no
    metrics.jsonl) is not silently overwritten by another recipe."""
    w = World(tmp_path, data_dir, llama_dir)
    (w.old / "metrics.jsonl").unlink()
    w.write_recipe()
    before = snapshot(w.old)
    assert main(["run", str(w.recipe), "--run-dir", str(w.old)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert snapshot(w.old) == before


def test_skipped_bad_rows_are_logged_by_line_and_too_many_exit_2(
    tmp_path, data_dir, llama_dir, capsys
):
    """data.bad_rows: skip trains on the good rows and names the bad ones in log.txt; more than
    data.max_bad_fraction of them is exit 2, nothing written."""
    rows = (data_dir / "train.jsonl").read_text().splitlines()
    rows[1] = '{"prompt": "no completion here"}'
    (tmp_path / "train.jsonl").write_text("\n".join(rows) + "\n")
    r = tiny_recipe(data_dir, llama_dir)
    r["data"] = {**r["data"], "train": str(tmp_path / "train.jsonl"), "bad_rows": "skip"}
    r["train"] = {**r["train"], "max_steps": 2}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(r))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "ok")]) == 0
    log = (tmp_path / "ok" / "log.txt").read_text()
    assert f"{tmp_path / 'train.jsonl'}:2: missing field 'completion'" in log
    r["data"]["max_bad_fraction"] = 0.001
    p.write_text(yaml.safe_dump(r))
    assert main(["run", str(p), "--run-dir", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "max_bad_fraction" in err and "Traceback" not in err
    assert not (tmp_path / "no").exists()
