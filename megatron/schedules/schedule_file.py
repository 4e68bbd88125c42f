"""Plain-text CSV form of a schedule, so that a user can inspect, edit and run their own.

Format: '#' header lines carry the configuration (key=value), then a CSV table with the
columns `rank,op,stage,sub,mb,peer`; a rank's instructions run in file order. Example:

    # pipeline-schedule v1
    # name=decoupled
    # ranks=4
    # forward_stages=8
    # backward_split=2
    # micro_batches=4
    # partition=2 2 2 2 2 2 2 2
    # forward_rank=0 1 2 3 0 1 2 3
    # backward_rank=7.1:0 7.0:1 ...
    rank,op,stage,sub,mb,peer
    0,PREFETCH_PARAMS,0,-1,-1,-1

Reading checks the syntax only; run `validate` on what was read.
"""

from __future__ import annotations

import csv
import io
import os

from megatron.common.files import atomic_write, missing_file

from .instructions import Instruction, Op, Schedule

MAGIC = "# pipeline-schedule v1"
COLUMNS = ["rank", "op", "stage", "sub", "mb", "peer"]


def schedule_to_csv(schedule: Schedule) -> str:
    s = schedule
    owners = " ".join(f"{i}.{k}:{rank}" for (i, k), rank in sorted(s.backward_rank.items()))
    lines = [
        MAGIC,
        f"# name={s.name}",
        f"# ranks={s.ranks}",
        f"# forward_stages={s.forward_stages}",
        f"# backward_split={s.backward_split}",
        f"# micro_batches={s.micro_batches}",
        f"# partition={' '.join(map(str, s.partition))}",
        f"# forward_rank={' '.join(map(str, s.forward_rank))}",
        f"# backward_rank={owners}",
    ]
    out = io.StringIO()
    out.write("\n".join(lines) + "\n")
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for rank, program in enumerate(s.programs):
        for ins in program:
            writer.writerow([rank, ins.op.value, ins.stage, ins.sub, ins.mb, ins.peer])
    return out.getvalue()


def write_schedule(schedule: Schedule, path: str) -> None:
    text = schedule_to_csv(schedule).encode()
    atomic_write(path, lambda stream: stream.write(text))


def _int(value: str, where: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{where}: {value!r} is not an integer") from None


def schedule_from_csv(text: str, source: str = "<schedule>") -> Schedule:
    """Parse the CSV form; raise ValueError naming the line for anything malformed."""
    lines = text.splitlines()
    if not lines or lines[0].strip() != MAGIC:
        raise ValueError(f"{source}: line 1 should be {MAGIC!r}")
    header: dict[str, str] = {}
    body_start = len(lines)
    for number, line in enumerate(lines[1:], start=2):
        if not line.startswith("#"):
            body_start = number - 1
            break
        key, sep, value = line[1:].strip().partition("=")
        if not sep:
            raise ValueError(f"{source}:{number}: header line should be '# key=value'")
        header[key.strip()] = value.strip()
    required = ["name", "ranks", "forward_stages", "backward_split", "micro_batches",
                "partition", "forward_rank", "backward_rank"]
    missing = [key for key in required if key not in header]
    if missing:
        raise ValueError(f"{source}: header lacks {', '.join(missing)}")
    ranks = _int(header["ranks"], f"{source}: ranks")
    config = {key: _int(header[key], f"{source}: {key}")
              for key in ("ranks", "forward_stages", "backward_split", "micro_batches")}
    partition = tuple(_int(v, f"{source}: partition") for v in header["partition"].split())
    forward_rank = tuple(_int(v, f"{source}: forward_rank") for v in header["forward_rank"].split())
    backward_rank = {}
    for item in header["backward_rank"].split():
        piece, _, rank = item.partition(":")
        stage, _, sub = piece.partition(".")
        where = f"{source}: backward_rank entry {item!r}"
        backward_rank[(_int(stage, where), _int(sub, where))] = _int(rank, where)
    if ranks < 1:
        raise ValueError(f"{source}: ranks is {ranks}, expected >= 1")
    programs: list[list[Instruction]] = [[] for _ in range(ranks)]
    reader = csv.reader(lines[body_start:])
    columns = next(reader, None)
    if columns != COLUMNS:
        raise ValueError(f"{source}:{body_start + 1}: expected columns {','.join(COLUMNS)}")
    for offset, row in enumerate(reader, start=body_start + 2):
        if not row:
            continue
        where = f"{source}:{offset}"
        if len(row) != len(COLUMNS):
            raise ValueError(f"{where}: expected {len(COLUMNS)} fields, got {len(row)}")
        rank = _int(row[0], where)
        if not 0 <= rank < ranks:
            raise ValueError(f"{where}: rank {rank} is not in 0..{ranks - 1}")
        try:
            op = Op(row[1])
        except ValueError:
            raise ValueError(f"{where}: unknown op {row[1]!r}") from None
        stage, sub, mb, peer = (_int(v, where) for v in row[2:])
        programs[rank].append(Instruction(op, stage=stage, sub=sub, mb=mb, peer=peer))
    pieces = {(i, k) for i in range(config["forward_stages"])
              for k in range(config["backward_split"])}
    if len(forward_rank) != config["forward_stages"] or set(backward_rank) != pieces:
        raise ValueError(f"{source}: forward_rank/backward_rank do not cover every stage")
    if not all(0 <= r < ranks for r in (*forward_rank, *backward_rank.values())):
        raise ValueError(f"{source}: forward_rank/backward_rank name a rank outside 0..{ranks - 1}")
    if len(partition) != config["forward_stages"]:
        raise ValueError(f"{source}: partition has {len(partition)} entries, expected "
                         f"{config['forward_stages']}")
    return Schedule(name=header["name"], partition=partition, forward_rank=forward_rank,
                    backward_rank=backward_rank, programs=tuple(map(tuple, programs)), **config)


def read_schedule(path: str) -> Schedule:
    if not os.path.isfile(path):
        raise ValueError(f"schedule file {path!r}: {missing_file(path)}")
    try:
        with open(path, encoding="utf-8") as stream:
            text = stream.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"schedule file {path!r} is not a UTF-8 CSV (byte {exc.start}: "
                         f"{exc.reason}); write one with tools/simulate_pipeline.py "
                         "--schedule-file") from None
    except OSError as exc:
        raise ValueError(f"schedule file {path!r} cannot be read ({exc.strerror})") from None
    return schedule_from_csv(text, source=path)
