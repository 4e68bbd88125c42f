"""Pipeline schedules as data (generators, validator, simulator, timelines) and the executor.

Public API of the schedule side; see docs/schedules.md.
"""

from .cost_model import CostModel, HardwareProfile, derived_costs, model_partition, uniform_costs
from .generators import SCHEDULE_NAMES, build_schedule, decoupled_assignment
from .instructions import WHOLE_STAGE, Instruction, Op, Schedule
from .interpreter import ScheduleError
from .partition import LayerRange, balanced_partition, stage_layers, sub_stage_layers
from .schedule_file import read_schedule, schedule_from_csv, schedule_to_csv, write_schedule
from .simulator import SimResult, simulate
from .timeline import TimedEvent, write_chrome_trace, write_timeline_png
from .validator import ValidationReport, validate

__all__ = [
    "SCHEDULE_NAMES", "WHOLE_STAGE", "CostModel", "HardwareProfile", "Instruction", "LayerRange",
    "Op", "Schedule", "ScheduleError", "SimResult", "TimedEvent", "ValidationReport",
    "balanced_partition", "build_schedule", "decoupled_assignment", "derived_costs",
    "model_partition", "read_schedule", "schedule_from_csv", "schedule_to_csv", "simulate",
    "stage_layers", "sub_stage_layers", "uniform_costs", "validate", "write_chrome_trace",
    "write_schedule", "write_timeline_png",
]
