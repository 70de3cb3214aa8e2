import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from conftest import MINIMAL_RECIPE, REPO, tiny_recipe
from mlxtune import config as R
from mlxtune.cli import main
from mlxtune.config.reference import recipe_reference
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
        ("optimizer.adafactor.decay_rate=0.5", "optimizer.adafactor.decay_rate"),
        ("optimizer.adafactor.eps=[0.001]", "optimizer.adafactor.eps"),
        ("optimizer.adafactor.beta1=1.0", "optimizer.adafactor.beta1"),
        ("optimizer.adafactor.clip_threshold=0", "optimizer.adafactor.clip_threshold"),
        ("schedule.decay_fraction=0", "schedule.decay_fraction"),
        ("optimizer.name=sophie", "optimizer.name"),
        ("optimizer.muon.lr_scale=0", "optimizer.muon.lr_scale"),
        ("optimizer.muon.momentum=1", "optimizer.muon.momentum"),
        ("optimizer.muon.ns_steps=0", "optimizer.muon.ns_steps"),
        ("optimizer.muon.weight_decay_scale=-1", "optimizer.muon.weight_decay_scale"),
        ("adapter.lora_plus_ratio=0", "adapter.lora_plus_ratio"),
        ("train.early_stopping.patience=0", "train.early_stopping.patience"),
        ("train.early_stopping.min_delta=-0.1", "train.early_stopping.min_delta"),
        ("train.early_stopping.metric=loss", "train.early_stopping.metric"),
        ("train.early_stopping.mode=up", "train.early_stopping.mode"),
        ("data.valid_size=0", "data.valid_size"),
        ("data.valid_size=1.0", "data.valid_size"),
        ("data.test_size=-3", "data.test_size"),
        ("data.test_size=true", "data.test_size"),
    ],
)
def test_impossible_values_are_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(UserInputError) as e:
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), [override])
    assert key in str(e.value)
    assert "override" in str(e.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["checkpoints.save_best=false", "checkpoints.load_best_at_end=true"], "load_best_at_end"),
        (["eval.every=null", "train.early_stopping.patience=3"], "train.early_stopping.patience"),
        (["data.valid_fraction=0.1", "data.valid_size=20"], "data.valid_size"),
    ],
)
def test_settings_that_need_another_are_refused_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(UserInputError) as e:
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), overrides)
    assert key in str(e.value)


def test_literal_typo_gets_a_suggestion(tmp_path):
    with pytest.raises(UserInputError, match="did you mean 'lora'"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["adapter.type=lorra"])
    # the same word in other letters' case is the suggestion, before any closer spelling
    with pytest.raises(UserInputError, match="did you mean 'adamw'"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["optimizer.name=AdamW"])


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


def test_cli_validate_reports_a_missing_init_from_adapter(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    p = write(tmp_path, MINIMAL_RECIPE + "adapter:\n  init_from: no-such-adapter\n")
    assert main(["validate", str(p)]) == 2
    assert f"file not found: adapter.init_from: {tmp_path / 'no-such-adapter'}" in (
        capsys.readouterr().err
    )


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


# ------------------------------------------------------------------ the objective section


@dataclasses.dataclass
class WeightedObjective(R.ObjectiveConfig):
    """A test-only objective with one key of its own."""

    type: str = "test-weighted"
    """The objective's name."""
    weight: float = 1.0
    """How much the loss counts."""


@dataclasses.dataclass
class UndocumentedObjective(R.ObjectiveConfig):
    type: str = "test-undocumented"
    """The objective's name."""
    weight: float = 1.0


@dataclasses.dataclass
class MisnamedObjective(R.ObjectiveConfig):
    weight: float = 1.0
    """How much the loss counts."""


@pytest.fixture
def weighted():
    """WeightedObjective registered as "test-weighted" for one test, removed after it."""
    assert "test-weighted" not in R.OBJECTIVE_CONFIGS
    R.register_objective_config("test-weighted", WeightedObjective)
    yield WeightedObjective
    R.OBJECTIVE_CONFIGS.pop("test-weighted")


WEIGHTED = MINIMAL_RECIPE + "objective:\n  type: test-weighted\n  weight: 0.25\n"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_with_its_objective_and_no_inert_keys(path):
    r = R.load_recipe(path)
    assert type(r.objective) is R.OBJECTIVE_CONFIGS[r.objective.type]
    kinds = {
        "quickstart-dpo.yaml": "dpo",
        "quickstart-grpo.yaml": "grpo",
        "quickstart-tools.yaml": "grpo",
        "quickstart-ppo.yaml": "ppo",
        "quickstart-online-dpo.yaml": "online_dpo",
        "quickstart-kto.yaml": "kto",
        "quickstart-distill.yaml": "distill",
    }
    assert r.objective.type == kinds.get(path.name, "sft")
    assert R.inert_keys(r) == []


def test_the_objective_defaults_to_sft(tmp_path):
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE))
    assert type(r.objective) is R.SFTConfig and r.objective.type == "sft"
    assert r.objective.router_aux_loss_coef == 0.0
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE + "objective:\n  type: sft\n"))
    assert type(r.objective) is R.SFTConfig and r.objective.type == "sft"
    with pytest.raises(UserInputError, match=r"r.yaml:10: objective.weight: unknown key"):
        R.load_recipe(write(tmp_path, MINIMAL_RECIPE + "objective:\n  type: sft\n  weight: 2\n"))


def test_a_registered_objective_loads_as_its_class(tmp_path, weighted):
    r = R.load_recipe(write(tmp_path, WEIGHTED))
    assert type(r.objective) is weighted
    assert (r.objective.type, r.objective.weight) == ("test-weighted", 0.25)
    text = MINIMAL_RECIPE + "objective:\n  type: test-weighted\n"
    assert R.load_recipe(write(tmp_path, text)).objective.weight == 1.0  # its default
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["objective.type=test-weighted"])
    assert type(r.objective) is weighted and r.objective.weight == 1.0
    r = R.load_recipe(write(tmp_path, WEIGHTED), ["objective.weight=3"])
    assert r.objective.weight == 3.0


def test_a_registered_objective_checks_types_with_the_line(tmp_path, weighted):
    p = write(tmp_path, WEIGHTED.replace("weight: 0.25", "weight: heavy"))
    with pytest.raises(
        UserInputError, match=r"r.yaml:10: objective.weight: expected a number, got 'heavy'"
    ):
        R.load_recipe(p)
    with pytest.raises(UserInputError, match=r"override 'objective.weight=\[1\]'"):
        R.load_recipe(write(tmp_path, WEIGHTED), ["objective.weight=[1]"])
    p = write(tmp_path, WEIGHTED.replace("type: test-weighted", "type: 3"))
    with pytest.raises(UserInputError, match=r"r.yaml:9: objective.type: expected a string"):
        R.load_recipe(p)


def test_a_registered_objective_suggests_its_own_keys(tmp_path, weighted):
    p = write(tmp_path, WEIGHTED.replace("weight: 0.25", "wieght: 0.25"))
    with pytest.raises(UserInputError) as e:
        R.load_recipe(p)
    msg = str(e.value)
    assert f"{p}:10: objective.wieght: unknown key" in msg
    assert "did you mean 'weight'" in msg and "known here: type, weight" in msg


def test_an_unknown_objective_type_lists_the_registered_ones(tmp_path, weighted):
    p = write(tmp_path, WEIGHTED.replace("type: test-weighted", "type: test-weigted"))
    with pytest.raises(UserInputError) as e:
        R.load_recipe(p)
    msg = str(e.value)
    assert f"{p}:9: objective.type: unknown objective 'test-weigted'" in msg
    assert (
        "did you mean 'test-weighted'" in msg
        and "registered: sft, dpo, orpo, cpo, reward, kto, distill, grpo, ppo, online_dpo, test-weighted"
        in msg
    )
    assert main(["validate", str(p)]) == 2


def test_an_objective_unregistered_again_is_unknown(tmp_path, weighted):
    R.OBJECTIVE_CONFIGS.pop("test-weighted")
    try:
        with pytest.raises(
            UserInputError,
            match=r"unknown objective .*\(registered: sft, dpo, orpo, cpo, reward, kto, distill, grpo, ppo, online_dpo\)",
        ):
            R.load_recipe(write(tmp_path, WEIGHTED))
    finally:
        R.register_objective_config("test-weighted", WeightedObjective)


def test_a_registered_objective_round_trips(tmp_path, weighted):
    r = R.load_recipe(write(tmp_path, WEIGHTED))
    d = r.to_dict()
    assert d["objective"] == {"type": "test-weighted", "weight": 0.25}
    assert "explicit" not in d and "source" not in d
    again = R.recipe_from_dict(d)
    assert type(again.objective) is weighted and again.objective == r.objective
    assert again.to_dict() == d
    from_yaml = R.recipe_from_dict(R.parse_yaml(R.dump_yaml(d), "dumped"))
    assert from_yaml.to_dict() == d
    # a dict without an objective section trains sft
    del d["objective"]
    assert R.recipe_from_dict(d).objective == R.SFTConfig()
    # an instance made in code knows its objective
    r.objective = weighted(weight=2.0)
    assert R.recipe_from_dict(r.to_dict()).objective == weighted(weight=2.0)


def test_validate_accepts_a_registered_objective(tmp_path, weighted, capsys):
    (tmp_path / "train.jsonl").write_text("")
    assert main(["validate", str(write(tmp_path, WEIGHTED))]) == 0
    assert "ok" in capsys.readouterr().out


def test_register_objective_config_refuses_what_it_cannot_read():
    before = dict(R.OBJECTIVE_CONFIGS)
    with pytest.raises(TypeError, match="not a dataclass subclass of ObjectiveConfig"):
        R.register_objective_config("test-x", R.OptimizerConfig)
    with pytest.raises(ValueError, match="needs a docstring"):
        R.register_objective_config("test-undocumented", UndocumentedObjective)
    with pytest.raises(ValueError, match="must default to 'test-misnamed'"):
        R.register_objective_config("test-misnamed", MisnamedObjective)
    with pytest.raises(ValueError, match="registered already"):
        R.register_objective_config("sft", WeightedObjective)
    with pytest.raises(ValueError, match="non-empty string"):
        R.register_objective_config("", WeightedObjective)
    assert R.OBJECTIVE_CONFIGS == before
    R.register_objective_config("sft", R.SFTConfig)  # the same class again: nothing
    assert R.OBJECTIVE_CONFIGS == before


def test_field_docs_of_a_subclass_include_the_base_fields():
    assert set(R.field_docs(WeightedObjective)) == {"type", "weight"}
    assert R.field_docs(MisnamedObjective)["type"] == R.field_docs(R.ObjectiveConfig)["type"]


def test_run_dry_run_accepts_an_objective_section(
    tmp_path, data_dir, llama_dir, capsys, monkeypatch
):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(tiny_recipe(data_dir, llama_dir, objective={"type": "sft"})))
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(p), "--dry-run"]) == 0
    assert "dry run: one step compiled" in capsys.readouterr().err


# ------------------------------------------------------------------ keys without effect


def recipe_text(**sections) -> str:
    """MINIMAL_RECIPE as YAML with keys added to its sections (a key given None is removed)."""
    r = {
        "name": "t",
        "model": {"path": "some/model"},
        "data": {"train": "train.jsonl"},
        "train": {"max_steps": 10},
    }
    for k, v in sections.items():
        r[k] = {key: x for key, x in {**r.get(k, {}), **v}.items() if x is not None}
    return yaml.safe_dump(r, sort_keys=False)


def validate_notes(tmp_path, capsys, text: str, *overrides: str) -> dict[str, str]:
    """``mlxtune validate`` on ``text``: its notes, as {key: why}; it must exit 0."""
    for name in ("train", "valid", "test"):
        (tmp_path / f"{name}.jsonl").write_text("")
    p = write(tmp_path, text)
    assert main(["validate", str(p), *overrides]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"{p}: ok" in out[0]
    notes = {}
    for line in out[1:]:
        m = re.fullmatch(r"note: (\S+) has no effect: (.+)", line)
        assert m, line
        notes[m[1]] = m[2]
    return notes


SCRATCH = {
    "model": {"path": None, "arch": {"model_type": "llama"}},
    "adapter": {"type": "full"},
    "tokenizer": {"train": {"vocab_size": 40}},
}


@pytest.mark.parametrize(
    "sections, expected",
    [
        (
            {"data": {"packing": "pack", "bucket_size": 4, "pad_to_multiple": 16}},
            {"data.bucket_size": "data.packing is pack"},  # evaluation still pads to 16
        ),
        (
            {"data": {"packing": "stream", "bucket_size": 4, "overlong": "drop"}},
            {"data.bucket_size": "data.packing is stream", "data.overlong": "data.packing is"},
        ),
        (
            {"data": {"packing": "off", "mask_boundary_loss": False}},
            {"data.mask_boundary_loss": "data.packing is off"},
        ),
        (
            {"data": {"valid": "valid.jsonl", "valid_fraction": 0.2}},
            {"data.valid_fraction": "data.valid is given"},
        ),
        (
            {
                "data": {
                    "valid": "valid.jsonl",
                    "test": "test.jsonl",
                    "valid_size": 9,
                    "test_size": 0.1,
                }
            },
            {"data.valid_size": "data.valid is given", "data.test_size": "data.test is given"},
        ),
        (
            {"data": {"valid": "valid.jsonl", "split_seed": 4}},
            {"data.split_seed": "nothing is held out"},
        ),
        ({"data": {"valid": "valid.jsonl", "test_size": 5, "split_seed": 4}}, {}),
        (
            {"model": {"dequantize": True}},
            {"model.dequantize": "it applies to a GGUF base"},
        ),
        (
            {"model": {"path": "some/model.gguf", "dequantize": True}, "adapter": {"type": "full"}},
            {"model.dequantize": "a full fine-tune de-quantizes every weight"},
        ),
        ({"model": {"path": "some/model.gguf", "dequantize": True}}, {}),
        (
            {"data": {"add_eos": False, "train_on_eos": False}},
            {"data.train_on_eos": "data.add_eos is false"},
        ),
        (
            {"optimizer": {"name": "adamw", "momentum": 0.5}},
            {"optimizer.momentum": "optimizer.name is adamw"},
        ),
        (
            {"optimizer": {"name": "adam", "momentum": 0.5, "weight_decay": 0.0}},
            {"optimizer.momentum": "is adam", "optimizer.weight_decay": "is adam"},
        ),
        (
            {"optimizer": {"name": "sgd", "betas": [0.8, 0.9], "eps": 1e-6}},
            {"optimizer.betas": "optimizer.name is sgd", "optimizer.eps": "is sgd"},
        ),
        (
            {"optimizer": {"name": "sgd", "bias_correction": False}},
            {"optimizer.bias_correction": "optimizer.name is sgd"},
        ),
        (
            {"optimizer": {"name": "lion", "eps": 1e-6, "betas": [0.9, 0.99], "momentum": 0.5}},
            {"optimizer.eps": "optimizer.name is lion", "optimizer.momentum": "is lion"},
        ),
        (
            {"optimizer": {"name": "adafactor", "betas": [0.9, 0.99], "adafactor": {"beta1": 0.9}}},
            {"optimizer.betas": "optimizer.name is adafactor"},
        ),
        (
            {"optimizer": {"name": "adamw", "adafactor": {"clip_threshold": 2.0}}},
            {"optimizer.adafactor.clip_threshold": "optimizer.name is adamw"},
        ),
        (
            {"optimizer": {"name": "lion", "muon": {"lr_scale": 2.0, "adapters": True}}},
            {"optimizer.muon.lr_scale": "is lion", "optimizer.muon.adapters": "is lion"},
        ),
        (
            {
                "adapter": {"type": "full"},
                "optimizer": {"name": "muon", "momentum": 0.5, "muon": {"adapters": True}},
            },
            {"optimizer.muon.adapters": "adapter.type is full", "optimizer.momentum": "is muon"},
        ),
        (
            {"train": {"max_steps": 5, "early_stopping": {"min_delta": 0.1}}},
            {"train.early_stopping.min_delta": "patience is null"},
        ),
        (
            {"adapter": {"type": "full", "rslora": True, "lora_plus_ratio": 16}},
            {"adapter.rslora": "is full", "adapter.lora_plus_ratio": "is full"},
        ),
        (
            {"schedule": {"name": "cosine", "decay_fraction": 0.2}},
            {"schedule.decay_fraction": "schedule.name is cosine"},
        ),
        (
            {
                "adapter": {
                    "type": "full",
                    "rank": 4,
                    "alpha": 8,
                    "dropout": 0.1,
                    "targets": ["q_proj"],
                    "layers": 2,
                }
            },
            {
                f"adapter.{k}": "adapter.type is full"
                for k in "rank alpha dropout targets layers".split()
            },
        ),
        (
            {"precision": {"growth_factor": 4.0, "growth_interval": 10, "backoff_factor": 0.25}},
            {
                f"precision.{k}": "loss scaling is none (precision.loss_scale auto with model.dtype float32)"
                for k in ("growth_factor", "growth_interval", "backoff_factor")
            },
        ),
        (
            {"precision": {"loss_scale": "static", "init_scale": 1024.0, "min_scale": 2.0}},
            {"precision.min_scale": "precision.loss_scale is static"},
        ),
        (
            {"precision": {"loss_scale": "none", "init_scale": 1024.0}},
            {"precision.init_scale": "precision.loss_scale is none"},
        ),
        (
            {"model": {"dtype": "float32"}, "precision": {"master_weights": False}},
            {"precision.master_weights": "model.dtype is float32"},
        ),
        (
            {"precision": {"nonfinite": "stop", "max_skipped": 3}},
            {"precision.max_skipped": "precision.nonfinite is stop"},
        ),
        (
            {"schedule": {"name": "constant", "min_lr": 1e-5, "warmup_steps": 3}},
            {"schedule.min_lr": "schedule.name is constant"},  # constant still warms up
        ),
        ({"train": {"epochs": 2}}, {"train.epochs": "train.max_steps is set"}),
        ({"eval": {"max_new_tokens": 8}}, {"eval.max_new_tokens": "eval.exact_match is 0"}),
        (
            {"samples": {"every": 5, "prompts": ["hi"], "count": 5}},
            {"samples.count": "samples.prompts is given"},
        ),
        (
            {"samples": {"prompts": ["hi"], "max_new_tokens": 8, "temperature": 0.5}},
            {
                f"samples.{k}": "samples.every is null"
                for k in ("prompts", "max_new_tokens", "temperature")
            },
        ),
        ({"model": {"seed": 3}}, {"model.seed": "the model is loaded from model.path"}),
        (
            {
                **SCRATCH,
                "model": {"path": None, "arch": {"model_type": "llama"}, "trust_remote_code": True},
                "tokenizer": {"train": {"vocab_size": 40}, "path": "tok"},
            },
            {
                "model.trust_remote_code": "no code is loaded",
                "tokenizer.path": "tokenizer.train trains a new tokenizer",
            },
        ),
        (
            {"memory": {"check": "off", "limit_gb": 4}},
            {"memory.limit_gb": "memory.check is off"},
        ),
    ],
    ids=lambda x: ",".join(x) if isinstance(x, dict) and "." in next(iter(x), "") else None,
)
def test_validate_notes_each_key_that_has_no_effect(tmp_path, capsys, sections, expected):
    notes = validate_notes(tmp_path, capsys, recipe_text(**sections))
    assert set(notes) == set(expected)
    for key, why in expected.items():
        assert why in notes[key], (key, notes[key])


@pytest.mark.parametrize(
    "sections",
    [
        {},  # every key at its default: momentum 0.9 under adamw, rank 8 ... is never named
        {"adapter": {"type": "full"}},  # rank, alpha, targets left at their defaults
        {"data": {"packing": "pack"}},  # bucket_size and pad_to_multiple left at their defaults
        # the same keys where they matter
        {"data": {"packing": "off", "bucket_size": 4, "pad_to_multiple": 16}},
        {"data": {"packing": "pack", "pad_to_multiple": 16, "mask_boundary_loss": False}},
        {"data": {"packing": "stream", "overlong": "drop", "valid": "valid.jsonl"}},
        {"data": {"packing": "stream", "overlong": "drop", "test": "test.jsonl"}},
        {"data": {"valid_fraction": 0.2, "add_eos": True, "train_on_eos": False}},
        {"optimizer": {"name": "sgd", "momentum": 0.5, "weight_decay": 0.1}},
        {"optimizer": {"name": "adamw", "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}},
        {"adapter": {"type": "lora", "rank": 4, "alpha": 8, "dropout": 0.1, "layers": 2}},
        {
            "precision": {
                "loss_scale": "dynamic",
                "init_scale": 1024.0,
                "growth_factor": 4.0,
                "growth_interval": 10,
                "backoff_factor": 0.25,
                "min_scale": 2.0,
            }
        },
        {"model": {"path": "some/model", "dtype": "float16"}, "precision": {"growth_factor": 4.0}},
        {
            "model": {"path": "some/model", "dtype": "bfloat16"},
            "precision": {"master_weights": False},
        },
        {"precision": {"loss_scale": "static", "init_scale": 1024.0}},
        {"precision": {"nonfinite": "skip", "max_skipped": 3}},
        {"schedule": {"name": "linear", "min_lr": 1e-5, "warmup_steps": 3}},
        {"schedule": {"name": "constant", "warmup_steps": 3}},
        {"train": {"max_steps": None, "epochs": 2}},
        {"eval": {"exact_match": 5, "max_new_tokens": 8}},
        {"samples": {"every": 5, "count": 5, "max_new_tokens": 8, "temperature": 0.5}},
        {**SCRATCH, "model": {"path": None, "arch": {"model_type": "llama"}, "seed": 3}},
        {"model": {"path": "some/model", "trust_remote_code": True}, "tokenizer": {"path": "t"}},
        {"memory": {"check": "warn", "limit_gb": 4}},
    ],
)
def test_validate_notes_nothing_where_the_keys_matter(tmp_path, capsys, sections):
    assert validate_notes(tmp_path, capsys, recipe_text(**sections)) == {}


def test_keys_set_by_an_override_are_noted_too(tmp_path, capsys):
    notes = validate_notes(tmp_path, capsys, recipe_text(), "optimizer.momentum=0.5")
    assert notes == {"optimizer.momentum": "optimizer.name is adamw"}
    # an override that makes a written key matter silences its note
    text = recipe_text(optimizer={"momentum": 0.5})
    assert validate_notes(tmp_path, capsys, text, "optimizer.name=sgd") == {}


def test_pack_length_with_packing_off_is_refused_not_noted(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    p = write(tmp_path, recipe_text(data={"packing": "off", "pack_length": 64}))
    assert main(["validate", str(p)]) == 2
    assert "data.pack_length: is for packed rows" in capsys.readouterr().err


def test_explicit_holds_the_keys_written_and_only_those(tmp_path):
    r = R.load_recipe(write(tmp_path, MINIMAL_RECIPE), ["adapter.targets=[q_proj]"])
    assert r.explicit == {
        "name",
        "model",
        "model.path",
        "data",
        "data.train",
        "train",
        "train.max_steps",
        "adapter",
        "adapter.targets",
    }


def test_an_override_path_is_taken_from_where_it_was_typed(tmp_path, monkeypatch):
    """Typed at the repository root, data.train=recipes/data/... is that file, not one under
    the recipe's folder; a path written in the recipe stays relative to the recipe; a model
    override that is no folder here stays as given (a Hub id)."""
    (tmp_path / "recipes" / "data").mkdir(parents=True)
    (tmp_path / "recipes" / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "models" / "base").mkdir(parents=True)
    p = write(tmp_path / "recipes", MINIMAL_RECIPE.replace("train.jsonl", "data/train.jsonl"))
    monkeypatch.chdir(tmp_path)
    r = R.load_recipe(p)
    assert r.resolve_path(r.data.train) == tmp_path / "recipes" / "data" / "train.jsonl"
    r = R.load_recipe(
        p,
        [
            "data.train=recipes/data/train.jsonl",
            "data.valid=recipes/data/missing.jsonl",  # named where the user meant it
            "model.path=models/base",
            "tokenizer.path=org/some-tokenizer",
        ],
    )
    assert r.resolve_path(r.data.train) == tmp_path / "recipes" / "data" / "train.jsonl"
    assert r.resolve_path(r.data.valid) == tmp_path / "recipes" / "data" / "missing.jsonl"
    assert r.resolve_path(r.model.path) == tmp_path / "models" / "base"
    assert r.tokenizer.path == "org/some-tokenizer"
    r = R.load_recipe(p, ["model.path=org/model", "data.test=/abs/test.jsonl"])
    assert r.model.path == "org/model" and r.data.test == "/abs/test.jsonl"


@pytest.mark.parametrize(
    "objective, key, message",
    [
        ({"type": "dpo", "beta": -1}, "objective.beta", "must be greater than 0, got -1"),
        (
            {"type": "dpo", "loss": "hinge", "label_smoothing": 0.1},
            "objective.label_smoothing",
            "must be 0 with loss hinge",
        ),
        ({"type": "orpo", "beta": 0}, "objective.beta", "must be greater than 0"),
        (
            {"type": "reward", "center_rewards": -1},
            "objective.center_rewards",
            "must be at least 0",
        ),
        ({"type": "cpo", "simpo_gamma": -1}, "objective.simpo_gamma", "must be at least 0"),
        ({"type": "grpo", "top_p": 0}, "objective.top_p", "must be in (0, 1]"),
        ({"type": "grpo", "epsilon": 1.5}, "objective.epsilon", "must be in [0, 1)"),
        ({"type": "ppo", "lam": 2}, "objective.lam", "must be in [0, 1]"),
        (
            {"type": "online_dpo", "num_generations": 3},
            "objective.num_generations",
            "must be 2 (a pair",
        ),
    ],
)
def test_validate_refuses_an_objectives_bad_values_at_their_line(
    tmp_path, capsys, objective, key, message
):
    """Checked with the recipe, before any model or data is read: file, line and key."""
    p = write(tmp_path, recipe_text(objective=objective))
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    line = next(
        i for i, x in enumerate(p.read_text().splitlines(), 1) if x.strip().startswith(key[10:])
    )
    assert f"{p}:{line}: {key}: {message}" in err, err


def test_docs_recipe_md_is_the_schema_written_out_and_keys_prints_a_section(capsys):
    text = recipe_reference()
    page = (REPO / "docs" / "recipe.md").read_text()
    assert page == text, "docs/recipe.md is stale: run mlxtune keys --write docs/recipe.md"
    # every section's keys with their docstrings, every registered objective's too
    for section, cls in (("data", R.DataConfig), ("train", R.TrainConfig)):
        for key, doc in R.field_docs(cls).items():
            assert f"| `{section}.{key}` |" in text and doc.replace("|", "\\|") in text
    for kind, cls in R.OBJECTIVE_CONFIGS.items():
        assert f"## `objective.type: {kind}`" in text
        for key in R.field_docs(cls):
            assert f"| `objective.{key}` |" in text
    assert main(["keys", "data"]) == 0
    out = capsys.readouterr().out
    assert "`data.max_length`" in out and "`model.path`" not in out
    assert main(["keys", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no section 'nope'" in err and "data" in err and "Traceback" not in err
