"""Turn a JSONL corpus ({"text": ...} per line, like OpenWebText dumps) into a Megatron
indexed dataset: OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx.

    python tools/preprocess_data.py --input owt.jsonl --tokenizer-model tokenizer.json \\
        --output-prefix data/owt --workers 8

Every document gets the tokenizer's end-of-document token appended. The output files
appear only when complete (written under temporary names, renamed at the end).
Exit status 2 on bad input, with a one-line message naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

# Run as a script from a checkout: make the repository root importable (as Megatron's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron.core warns on import that the GPU-only Apex/Transformer Engine are missing.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

from megatron.data.checks import DataError, check_writable_prefix  # noqa: E402
from megatron.data.indexed_dataset_writer import write_indexed_dataset  # noqa: E402
from megatron.data.jsonl import iter_jsonl_texts  # noqa: E402
from megatron.data.tokenizer import TokenizerError, load_tokenizer  # noqa: E402

PROG = "preprocess_data.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    p.add_argument("--tokenizer-model", required=True, help="tokenizer JSON (train_tokenizer.py)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text", help="field holding the text (default: text)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer threads (default: all cores)")
    return p


def bad_input(flag: str, value: object, problem: str) -> int:
    print(f"{PROG}: error: {flag} {value}: {problem}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        return bad_input("--workers", args.workers, "expected a positive number of threads")
    # The tokenizers library reads this when it first starts its thread pool.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    if not os.path.isfile(args.input):
        return bad_input("--input", args.input, "file not found (expected a JSONL file)")
    try:
        check_writable_prefix(args.output_prefix)
    except DataError as err:
        return bad_input("--output-prefix", args.output_prefix, str(err))
    try:
        tokenizer = load_tokenizer(args.tokenizer_model)
    except TokenizerError as err:
        return bad_input("--tokenizer-model", args.tokenizer_model, str(err))
    print(f"{PROG}: {args.input} -> {args.output_prefix}.bin/.idx "
          f"(vocabulary {tokenizer.vocab_size}, {args.workers} threads)", flush=True)
    try:
        stats = write_indexed_dataset(
            iter_jsonl_texts(args.input, args.json_key),
            tokenizer,
            args.output_prefix,
            log=lambda line: print(f"{PROG}: {line}", flush=True),
        )
    except DataError as err:
        return bad_input("--input", args.input, str(err))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no output written", file=sys.stderr)
        return 130
    print(f"{PROG}: wrote {args.output_prefix}.bin/.idx: {stats.documents} documents, "
          f"{stats.tokens} tokens ({stats.dtype}), {stats.input_bytes / 1e6:.1f} MB of text "
          f"in {stats.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
