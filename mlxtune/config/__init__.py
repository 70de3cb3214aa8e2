"""The recipe: one YAML file that describes a whole run, as typed, validated dataclasses.

``schema`` holds the dataclasses (their field docstrings are the reference, ``field_docs`` reads
them), ``load`` reads YAML and overrides and checks types, ``rules`` refuses impossible
combinations and names keys that have no effect (``inert_keys``).
"""

from .inert import inert_keys, inert_notes
from .load import (
    apply_overrides,
    dump_yaml,
    load_recipe,
    parse_override,
    parse_yaml,
    recipe_from_dict,
)
from .rules import check_values
from .schema import (
    OBJECTIVE_CONFIGS,
    AdapterConfig,
    CheckpointConfig,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    ExportConfig,
    KernelsConfig,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimizerConfig,
    PrecisionConfig,
    QATConfig,
    QuantizeConfig,
    Recipe,
    SamplesConfig,
    ScheduleConfig,
    SFTConfig,
    TokenizerConfig,
    TokenizerTrainConfig,
    TrainConfig,
    field_docs,
    register_objective_config,
    unregister_objective_config,
)

__all__ = [
    "OBJECTIVE_CONFIGS",
    "AdapterConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "ExportConfig",
    "KernelsConfig",
    "DistributedConfig",
    "MemoryConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "SFTConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "QATConfig",
    "QuantizeConfig",
    "Recipe",
    "SamplesConfig",
    "ScheduleConfig",
    "TokenizerConfig",
    "TokenizerTrainConfig",
    "TrainConfig",
    "apply_overrides",
    "check_values",
    "dump_yaml",
    "field_docs",
    "inert_keys",
    "inert_notes",
    "load_recipe",
    "parse_override",
    "parse_yaml",
    "recipe_from_dict",
    "register_objective_config",
    "unregister_objective_config",
]
