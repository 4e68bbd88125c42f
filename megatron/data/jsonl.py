"""Reading a JSONL corpus (one {"text": ...} object per line, like OpenWebText dumps): the
texts in order, and a DataError naming the file and line for the first bad line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from megatron.data.checks import DataError


def iter_jsonl_texts(path: str, json_key: str = "text") -> Iterator[str]:
    """The `json_key` string of each line of a JSONL file; blank lines are skipped.

    Raises DataError naming the file and line number for a line that is not a JSON object
    with a string under `json_key`.
    """
    if not os.path.isfile(path):
        raise DataError(f"'{path}': file not found (expected a JSONL file)")
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"'{path}' line {line_number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{where}: not valid UTF-8 (expected UTF-8 JSONL)") from None
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{where}: invalid JSON ({err.msg}); expected one JSON object per line"
                ) from None
            text = record.get(json_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{where}: expected a JSON object with a string field '{json_key}'")
            yield text
