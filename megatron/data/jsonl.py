"""Reading a JSONL corpus (one {"text": ...} object per line, like OpenWebText dumps): the
texts in order, and a DataError naming the file and line for the first bad line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence

from megatron.common.files import missing_file
from megatron.data.checks import DataError

# A field is one text, or (as Megatron's preprocessing reads it) a list of sentences.
Field = str | list[str]


def iter_jsonl_records(path: str, json_keys: Sequence[str] = ("text",)
                       ) -> Iterator[tuple[int, dict[str, Field]]]:
    """(line number, {key: text or list of texts}) for each non-blank line of a JSONL file.

    Raises DataError naming the file and line number for a line that is not a JSON object
    with a string (or a list of strings) under every key.
    """
    if not os.path.isfile(path):
        raise DataError(f"'{path}': {missing_file(path)} (expected a JSONL file)")
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
                raise DataError(f"{where}: not valid JSON ({_json_problem(err)}); expected "
                                "one JSON object per line") from None
            fields = {}
            for key in json_keys:
                value = record.get(key) if isinstance(record, dict) else None
                if not (isinstance(value, str) or isinstance(value, list)
                        and all(isinstance(v, str) for v in value)):
                    raise DataError(f"{where}: expected a JSON object with a string field "
                                    f"'{key}'")
                fields[key] = value
            yield line_number, fields


def iter_jsonl_texts(path: str, json_key: str = "text") -> Iterator[str]:
    """The `json_key` string of each line of a JSONL file; blank lines are skipped."""
    for line_number, fields in iter_jsonl_records(path, (json_key,)):
        text = fields[json_key]
        if not isinstance(text, str):
            raise DataError(f"'{path}' line {line_number}: expected a JSON object with a "
                            f"string field '{json_key}'")
        yield text


def _json_problem(err: json.JSONDecodeError) -> str:
    """The parser's complaint in words, with the column ("Invalid control character at"
    means a raw tab or newline inside a string)."""
    message = err.msg.removesuffix(" at")
    if message == "Invalid control character":
        message = "a raw control character such as a tab or newline inside a string; " \
                  "escape it as \\t or \\n"
    return f"column {err.colno}: {message}"
