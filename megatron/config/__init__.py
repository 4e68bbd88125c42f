"""The run's configuration: typed, frozen, checked once, read by every layer above.

Pure Python (no torch): the planner and the schedules' cost models read it without a
model, a GPU or a process group. Only megatron/training/arguments.py builds one from flags.
"""

from megatron.config.errors import ConfigError
from megatron.config.model import ModelConfig
from megatron.config.presets import PRESETS, ModelPreset, get_preset
from megatron.config.run import RunConfig

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "ModelPreset", "RunConfig", "get_preset"]
