"""Planning: will a run fit, how fast will it be, which shape is best.

Reads the run configuration, the schedules package and the model presets only (no torch,
no process group): the schedule a configuration asks for (`shape`), its memory and
simulated iteration against a hardware profile (`evaluate`), the configuration search
(`search`), the fit check against what a machine has free (`fit`) and what --plan prints
(`report`).
"""
