"""Train a byte-level BPE tokenizer offline (Hugging Face `tokenizers`) and save it as one
JSON file for --tokenizer-model.

    python tools/train_tokenizer.py --input owt.jsonl --vocab-size 32000 --output tok.json

Inputs ending in .jsonl/.json are read as JSONL (the --json-key field of each line); any
other file is read as plain UTF-8 text, one line per training example.
Exit status 2 on bad input, with a one-line message naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Iterator

# Run as a script from a checkout: make the repository root importable (as Megatron's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron.core warns on import that the GPU-only Apex/Transformer Engine are missing.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

from megatron.common.files import missing_file  # noqa: E402
from megatron.data.checks import DataError, check_writable_prefix  # noqa: E402
from megatron.data.jsonl import iter_jsonl_texts  # noqa: E402
from megatron.data.tokenizer import (  # noqa: E402
    MIN_VOCAB_SIZE,
    train_bpe_tokenizer,
)

PROG = "train_tokenizer.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, nargs="+", metavar="FILE",
                   help="JSONL (.jsonl/.json) or plain text files")
    p.add_argument("--vocab-size", required=True, type=int, help="vocabulary size")
    p.add_argument("--output", required=True, help="where to write the tokenizer JSON")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text")
    return p


def bad_input(flag: str, value: object, problem: str) -> int:
    print(f"{PROG}: error: {flag} {value}: {problem}", file=sys.stderr)
    return 2


def iter_texts(paths: list[str], json_key: str) -> Iterator[str]:
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            yield from iter_jsonl_texts(path, json_key)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield from f


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for path in args.input:
        if not os.path.isfile(path):
            return bad_input("--input", path, missing_file(path))
    if args.vocab_size < MIN_VOCAB_SIZE:
        return bad_input("--vocab-size", args.vocab_size,
                         f"expected at least {MIN_VOCAB_SIZE} (256 bytes + 2 special tokens)")
    try:
        check_writable_prefix(args.output)
    except DataError as err:
        return bad_input("--output", args.output, str(err))
    print(f"{PROG}: training a {args.vocab_size}-token byte-level BPE on "
          f"{len(args.input)} file(s)", flush=True)
    try:
        tokenizer = train_bpe_tokenizer(iter_texts(args.input, args.json_key),
                                        args.vocab_size, args.output)
    except DataError as err:
        return bad_input("--input", " ".join(args.input), str(err))
    print(f"{PROG}: wrote {args.output}: vocabulary {tokenizer.vocab_size}, "
          f"eod id {tokenizer.eod}, pad id {tokenizer.pad}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
