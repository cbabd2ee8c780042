"""Typed experiment configuration: dataclasses, YAML files with `include:`, dotted overrides.

An experiment is one YAML file whose top-level sections match `Config`'s fields. A file may
start with `include: [other.yaml, ...]` (paths relative to the file); included files are merged
first, in order, and the including file's keys win. Command-line overrides (`model.position=alibi`)
are applied last. Every value is type-checked and every cross-field constraint is checked before
any work starts; a violation raises `ConfigError` whose one-line message names the key, the value,
where it was set and what is allowed.

    megamlm config --config configs/model/base.yaml --config configs/variants/alibi.yaml \
        model.num_layers=6
"""

from megamlm.config.checks import ARCHITECTURE, ConfigError, check_fields, field_default
from megamlm.config.loading import (build_config, config_from_dict, load_config, load_config_and_origins,
                                    parse_override, replace_config)
from megamlm.config.model import GLOBAL_ATTENTION, LayerAttention
from megamlm.config.sections import (
    Config,
    DataConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    as_yaml,
)

__all__ = ["ARCHITECTURE", "Config", "ConfigError", "DataConfig", "GLOBAL_ATTENTION", "LayerAttention", "ModelConfig",
           "ObjectiveConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "as_yaml", "build_config", "check_fields",
           "config_from_dict", "field_default", "load_config", "load_config_and_origins", "parse_override",
           "replace_config"]
