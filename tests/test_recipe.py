import dataclasses
import typing
from pathlib import Path

import pytest

from conftest import MINIMAL_RECIPE, REPO
from mlxtune import recipe as R
from mlxtune.cli import main
from mlxtune.errors import UserInputError

SHIPPED = sorted((REPO / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_shipped_recipes_exist_and_have_a_command_header():
    assert {p.name for p in SHIPPED} >= {"quickstart.yaml", "quickstart-lora.yaml"}
    for p in SHIPPED:
        head = "".join(line for line in p.read_text().splitlines(True) if line.startswith("#"))
        assert f"mlxtune run recipes/{p.name}" in head, p


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path, capsys):
    assert main(["validate", str(path)]) == 0
    assert "ok" in capsys.readouterr().out


def _sections(cls):
    """The dataclass and every dataclass reachable through its field types."""
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c in out:
            continue
        out.append(c)
        for tp in typing.get_type_hints(c).values():
            todo += [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
    return out


def test_every_schema_field_has_a_docstring():
    sections = _sections(R.Recipe)
    assert R.TokenizerTrainConfig in sections and R.DataConfig in sections
    for cls in sections:
        docs = R.field_docs(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("internal"):
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"


def test_load_good_recipe_resolves_paths_relative_to_the_file(tmp_path):
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE))
    assert r.train.max_steps == 10
    assert r.resolve_path(r.data.train) == tmp_path / "train.jsonl"
    assert r.optimizer.lr == 1e-4 and r.adapter.type == "lora"


def test_unknown_key_suggests_and_names_the_line(tmp_path):
    p = write(tmp_path, MINIMAL_RECIPE + "  bach_size: 4\n")
    with pytest.raises(UserInputError) as e:
        R.load_recipe(p)
    msg = str(e.value)
    assert f"{p}:8: train.bach_size" in msg
    assert "did you mean 'batch_size'" in msg


def test_wrong_type_names_key_and_line(tmp_path):
    p = write(tmp_path, MINIMAL_RECIPE.replace("max_steps: 10", "max_steps: ten"))
    with pytest.raises(
        UserInputError, match=r"r.yaml:7: train.max_steps: expected an integer, got 'ten'"
    ):
        R.load_recipe(p)


@pytest.mark.parametrize(
    "override, key",
    [
        ("adapter.rank=0", "adapter.rank"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("adapter.dropout=1.5", "adapter.dropout"),
        ("train.label_smoothing=1.0", "train.label_smoothing"),
        ("adapter.type=lorra", "adapter.type"),
        ("schedule.min_lr=1.0", "schedule.min_lr"),
        ("adapter.layers=5-2", "adapter.layers"),
        ("optimizer.betas=[0.9]", "optimizer.betas"),
    ],
)
def test_impossible_values_are_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(UserInputError) as e:
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), [override])
    assert key in str(e.value)
    assert "override" in str(e.value)


def test_literal_typo_gets_a_suggestion(tmp_path):
    with pytest.raises(UserInputError, match="did you mean 'lora'"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["adapter.type=lorra"])


def test_overrides_set_nested_values_as_yaml(tmp_path):
    r = R.load_recipe(
        write(tmp_path, MINIMAL_RECIPE),
        ["train.batch_size=16", "adapter.targets=[q_proj, k_proj]", "optimizer.grad_clip=null"],
    )
    assert r.train.batch_size == 16
    assert r.adapter.targets == ["q_proj", "k_proj"]
    assert r.optimizer.grad_clip is None


def test_override_without_equals_is_refused(tmp_path):
    with pytest.raises(UserInputError, match="key.sub=value"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["train.batch_size"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    p = write(tmp_path, "name: t\nmodel:\n  path: [unclosed\ntrain:\n  max_steps: 3\n")
    with pytest.raises(UserInputError, match=r"r.yaml:\d+: YAML does not parse"):
        R.load_recipe(p)


def test_yaml_is_read_safely(tmp_path):
    p = write(tmp_path, MINIMAL_RECIPE + "extra: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(UserInputError, match="YAML does not parse"):
        R.load_recipe(p)


def test_needs_model_and_steps(tmp_path):
    with pytest.raises(UserInputError, match="model.path"):
        R.load_recipe(write(tmp_path, "data:\n  train: a.jsonl\ntrain:\n  max_steps: 3\n"))
    with pytest.raises(UserInputError, match="max_steps or train.epochs"):
        R.load_recipe(write(tmp_path, "model:\n  path: m\ndata:\n  train: a.jsonl\n"))


def test_scratch_model_needs_full_training_and_a_tokenizer(tmp_path):
    text = "model:\n  arch: {model_type: llama}\ndata:\n  train: a.jsonl\ntrain:\n  max_steps: 3\n"
    with pytest.raises(UserInputError, match="adapter.type: full"):
        R.load_recipe(write(tmp_path, text))
    with pytest.raises(UserInputError, match="tokenizer"):
        R.load_recipe(write(tmp_path, text), ["adapter.type=full"])


def test_cli_bad_recipe_exits_2_with_one_line_and_no_traceback(tmp_path, capsys):
    p = write(tmp_path, MINIMAL_RECIPE + "  bach_size: 4\n")
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0
    assert "train.bach_size" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err


def test_cli_validate_reports_missing_data_files(tmp_path, capsys):
    p = write(tmp_path, MINIMAL_RECIPE)
    assert main(["validate", str(p)]) == 2
    assert "data.train" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key",
    [
        ("optimizer.lr=1" + "0" * 400, "optimizer.lr"),
        ("samples.count=-1", "samples.count"),
        ("optimizer.name=adam", "optimizer.weight_decay"),
    ],
)
def test_more_impossible_values(tmp_path, override, key):
    extra = ["optimizer.weight_decay=0.1"] if "adam" in override else []
    with pytest.raises(UserInputError) as e:
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), [override, *extra])
    assert key in str(e.value)


@pytest.mark.parametrize(
    "arch, message",
    [
        ({"vocab_size": "100"}, "model.arch.vocab_size: must be a positive integer"),
        ({"num_attention_heads": 0}, "model.arch.num_attention_heads: must be a positive integer"),
        ({"hidden_size": 30}, "not a multiple of num_attention_heads"),
        ({"rope_scaling": "wrong"}, "cannot build this architecture"),
    ],
)
def test_bad_architectures_are_bad_input(arch, message):
    from mlxtune.models import build_model

    base = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-5,
    }
    with pytest.raises(UserInputError, match=message):
        build_model({**base, **arch}, 40)


def test_bare_off_in_yaml_means_the_word_off(tmp_path):
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE + "kernels:\n  attention: off\n"))
    assert r.kernels.attention == "off"
    assert (
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["kernels.attention=off"]).kernels.attention
        == "off"
    )
    with pytest.raises(UserInputError, match="kernels.loss"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["kernels.loss=off"])  # no such choice there
