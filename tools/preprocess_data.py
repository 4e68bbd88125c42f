"""Turn a JSONL corpus ({"text": ...} per line, like OpenWebText dumps) into Megatron indexed
datasets, with Megatron-LM's flags and file names:

    python tools/preprocess_data.py --input owt.jsonl --output-prefix data/owt \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok_dir --append-eod --workers 8

writes data/owt_text_document.bin/.idx (one PREFIX_{key}_document pair per --json-keys key),
byte-identical to Megatron-LM 0.16's tools/preprocess_data.py for the same tokenizer and
input. As in Megatron, EOD is appended only with --append-eod.

Without --tokenizer-type (this project's earlier form) --tokenizer-model is a tokenizer JSON
from tools/train_tokenizer.py, the output is PREFIX.bin/.idx and EOD is appended unless
--no-append-eod.

The output files appear only when complete (written under temporary names that carry the
process id, renamed at the end; removed on an error, Ctrl-C or SIGTERM; a later run removes
those a killed run left). Exit status 2 on bad input, with a one-line message naming the flag.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

# Run as a script from a checkout: make the repository root importable (as Megatron's tools do).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# megatron.core warns on import that the GPU-only Apex/Transformer Engine are missing.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex")

from megatron.common.files import missing_file  # noqa: E402
from megatron.config.tokenizer_names import TOKENIZER_TYPES  # noqa: E402
from megatron.data.checks import DataError, check_writable_prefix  # noqa: E402
from megatron.data.indexed_dataset_writer import write_indexed_datasets  # noqa: E402
from megatron.data.jsonl import iter_jsonl_records  # noqa: E402
from megatron.data.tokenizer import TokenizerError, load_tokenizer  # noqa: E402
from megatron.data.tokenizer_types import (  # noqa: E402
    TokenizerFlagError,
    TokenizerSpec,
    build_typed_tokenizer,
)

PROG = "preprocess_data.py"


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that the temporary files are removed."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("tokenizer (Megatron's flags)")
    g.add_argument("--tokenizer-type", default=None, metavar="|".join(TOKENIZER_TYPES),
                   help="Megatron's tokenizer name; without it --tokenizer-model is a "
                        "tokenizer JSON from tools/train_tokenizer.py")
    g.add_argument("--tokenizer-model", default=None,
                   help="Hugging Face directory / tokenizer JSON, or SentencePiece .model")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: ids 0..N-1 in the text, N-1 the end of document "
                        "(Megatron-LM 0.19)")
    g.add_argument("--tokenizer-hf-use-fast", action="store_true",
                   help="HuggingFaceTokenizer: the fast tokenizer where a slow one exists")
    g.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: add the tokenizer's BOS/EOS to each text")
    g.add_argument("--legacy-tokenizer", action="store_true",
                   help="Megatron's legacy tokenizers: Llama2Tokenizer puts BOS first, "
                        "HuggingFaceTokenizer adds its special tokens")
    g = p.add_argument_group("input and output")
    g.add_argument("--input", required=True, help="JSONL file, one JSON object per line")
    g.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{key}_document.bin/.idx (without --tokenizer-type: "
                        "PREFIX.bin/.idx)")
    g.add_argument("--json-keys", nargs="+", default=None, metavar="KEY",
                   help="fields holding the text, one dataset each (default: text)")
    g.add_argument("--json-key", default=None, help=argparse.SUPPRESS)  # the earlier name
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                   help="append the end-of-document token to each document (default: as "
                        "Megatron, only when given; without --tokenizer-type: on)")
    g.add_argument("--split-sentences", action="store_true", help="not supported (refused)")
    g.add_argument("--keep-newlines", action="store_true",
                   help="accepted for Megatron's command lines; only matters with "
                        "--split-sentences")
    g.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer threads (default: all cores)")
    g.add_argument("--log-interval", type=int, default=None,
                   help="a progress line every N documents (default: every 2 s)")
    return p


def bad_input(flag: str, value: object, problem: str) -> int:
    print(f"{PROG}: error: {flag} {value}: {problem}", file=sys.stderr)
    return 2


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    megatron_form = args.tokenizer_type is not None
    if args.split_sentences:
        return bad_input("--split-sentences", True, "sentence splitting (NLTK) is not "
                         "supported; expected one sequence per document")
    if args.json_keys and args.json_key:
        return bad_input("--json-key", args.json_key, "give --json-keys only")
    keys = args.json_keys or [args.json_key or "text"]
    if len(set(keys)) != len(keys):
        return bad_input("--json-keys", " ".join(keys), "expected distinct keys")
    if args.workers < 1:
        return bad_input("--workers", args.workers, "expected a positive number of threads")
    if args.log_interval is not None and args.log_interval < 1:
        return bad_input("--log-interval", args.log_interval, "expected a positive number")
    # The tokenizers library reads this when it first starts its thread pool.
    os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    if not os.path.isfile(args.input):
        return bad_input("--input", args.input, f"{missing_file(args.input)} (expected a JSONL "
                         "file)")
    try:
        check_writable_prefix(args.output_prefix)
    except DataError as err:
        return bad_input("--output-prefix", args.output_prefix, str(err))
    try:
        tokenizer = _build_tokenizer(args)
    except TokenizerFlagError as err:
        return bad_input(err.flag, err.value, err.problem)
    except TokenizerError as err:
        return bad_input("--tokenizer-model", args.tokenizer_model, str(err))
    append_eod = args.append_eod if args.append_eod is not None else not megatron_form
    if append_eod and tokenizer.eod is None:
        return bad_input("--append-eod", True, "the tokenizer has no end-of-document (eos) "
                         "token; expected one to append")
    prefixes = {k: (f"{args.output_prefix}_{k}_document" if megatron_form
                    else args.output_prefix) for k in keys}
    if not megatron_form and len(keys) > 1:
        return bad_input("--json-keys", " ".join(keys),
                         "several keys need --tokenizer-type (one PREFIX_{key}_document each)")
    names = ", ".join(f"{p}.bin/.idx" for p in prefixes.values())
    print(f"{PROG}: {args.input} -> {names} (vocabulary {tokenizer.vocab_size}, "
          f"end of document {'appended' if append_eod else 'not appended'}, "
          f"{args.workers} threads)", flush=True)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        stats = write_indexed_datasets(
            iter_jsonl_records(args.input, keys), tokenizer, prefixes,
            log=lambda line: print(f"{PROG}: {line}", flush=True),
            append_eod=append_eod, source=args.input, log_interval=args.log_interval,
        )
    except DataError as err:
        return bad_input("--input", args.input, str(err))
    except OSError as err:  # a full disk, say: a fault, not bad input; staged files removed
        print(f"{PROG}: error: writing {names} failed ({err.strerror or err}); no output "
              "written", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no output written", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{PROG}: terminated (SIGTERM); no output written", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"{PROG}: wrote {names}: {stats.documents} documents, "
          f"{stats.tokens} tokens ({stats.dtype}), {stats.input_bytes / 1e6:.1f} MB of text "
          f"in {stats.seconds:.1f} s")
    return 0


def _build_tokenizer(args: argparse.Namespace):
    if args.tokenizer_type is None:
        if args.tokenizer_model is None:
            raise TokenizerFlagError("--tokenizer-model", "missing",
                                     "expected a tokenizer JSON, or give --tokenizer-type")
        return load_tokenizer(args.tokenizer_model)
    return build_typed_tokenizer(TokenizerSpec(
        args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
        args.vocab_size, args.tokenizer_hf_use_fast, args.tokenizer_hf_include_special_tokens,
        args.legacy_tokenizer))


if __name__ == "__main__":
    sys.exit(main())
