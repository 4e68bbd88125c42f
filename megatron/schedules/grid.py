"""Programs as a compact rank x step grid, to show where a schedule goes wrong.

One row per rank, one column per instruction index; each cell is a short code (op
abbreviation, stage[.sub], :micro-batch, >peer). A window of columns around the marked
instruction keeps the grid readable for long programs.
"""

from __future__ import annotations

from .instructions import Instruction, Op, Schedule

_ABBREVIATIONS = {
    Op.PREFETCH_PARAMS: "P", Op.RELEASE_PARAMS: "R", Op.FORWARD: "F", Op.BACKWARD: "B",
    Op.SEND_ACT: "SA", Op.RECV_ACT: "RA", Op.SEND_GRAD: "SG", Op.RECV_GRAD: "RG",
    Op.ISEND_CKPT: "IS", Op.IRECV_CKPT: "IR", Op.WAIT_CKPT: "W", Op.OFFLOAD_GRAD: "OG",
    Op.OPTIMIZER_START: "O", Op.OPTIMIZER_WAIT_ALL: "OW", Op.OVERFLOW_SYNC: "OS",
    Op.POST_STEP_SYNC: "PS", Op.ROLLBACK_IF_OVERFLOW: "RB",
    Op.OPTIMIZER_START_SUBGROUPS: "OD", Op.READ_OPTIMIZER_STATES: "RS",
    Op.WRITE_OPTIMIZER_STATES: "WS",
}
LEGEND = ", ".join(f"{code}={op.value}" for op, code in _ABBREVIATIONS.items())


def cell(ins: Instruction) -> str:
    text = _ABBREVIATIONS[ins.op]
    if ins.stage >= 0:
        text += str(ins.stage) + (f".{ins.sub}" if ins.sub >= 0 else "")
    if ins.mb >= 0:
        text += f":{ins.mb}"
    if ins.peer >= 0:
        text += f">{ins.peer}"
    return text


def format_programs(schedule: Schedule, mark: tuple[int, int] | None = None,
                    width: int = 12) -> str:
    """The grid of `schedule`'s programs; `mark` = (rank, index) is drawn as [cell].

    With a mark, only `width` columns on each side of it are shown."""
    longest = max((len(p) for p in schedule.programs), default=0)
    first, last = 0, longest
    if mark is not None:
        first, last = max(0, mark[1] - width), min(longest, mark[1] + width + 1)
    rows = [["rank"] + [str(i) for i in range(first, last)]]
    for rank, program in enumerate(schedule.programs):
        row = [str(rank)]
        for index in range(first, last):
            text = cell(program[index]) if index < len(program) else ""
            if mark == (rank, index):
                text = f"[{text or 'end'}]"
            row.append(text)
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(w) for text, w in zip(row, widths)).rstrip() for row in rows]
    if first > 0 or last < longest:
        lines.insert(0, f"instructions {first}..{last - 1} of {longest}:")
    return "\n".join(lines + [LEGEND])
