"""Bad input, as the user gave it: the flag, the value and what was expected.

Raised wherever a configuration is checked (the run configuration, the schedule it asks
for, the data and checkpoint it names, the memory it needs) and turned into one line and
exit status 2 by the command line.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input: `flag`, `value`, and what was expected; `details` (optional) is printed
    before the line, e.g. the programs around a schedule's fault."""

    def __init__(self, flag: str, value: object, expected: str, details: str = "") -> None:
        self.flag, self.value, self.expected, self.details = flag, value, expected, details
        super().__init__(f"{flag} {value}: {expected}")


def flag_name(field: str) -> str:
    """The command-line flag of a configuration field: lr_warmup_iters -> --lr-warmup-iters."""
    return "--" + field.replace("_", "-")
