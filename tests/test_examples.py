"""The example launch scripts' flags are ones pretrain_llama.py accepts, for the processes
the script starts (what a user hits first when a flag is renamed or a default changes)."""

import os
import re
import shlex

import pytest

from megatron.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Variables the scripts expect from the user, with stand-ins
STAND_INS = {"DATA": "data/owt_text_document", "TOKENIZER": "data/tokenizer.json"}


def launch_flags(script: str) -> tuple[int, list[str]]:
    """(processes, the flags after pretrain_llama.py) of the script's torchrun line."""
    with open(os.path.join(ROOT, "examples", script)) as f:
        text = f.read().replace("\\\n", " ")
    line = next(line for line in text.splitlines()
                if "pretrain_llama.py" in line and not line.lstrip().startswith("#"))
    for name, value in STAND_INS.items():
        line = line.replace(f'"${name}"', value).replace(f"${name}", value)
    words = shlex.split(line)
    nproc = int(words[words.index("--nproc-per-node") + 1])
    flags = words[words.index("pretrain_llama.py") + 1:]
    return nproc, [w for w in flags if w != '"$@"' and w != "$@"]


@pytest.mark.unit
@pytest.mark.parametrize("script", ["train_tiny_cpu.sh", "pretrain_llama_10b_1node.sh"])
def test_an_example_launch_parses_for_its_processes(script, monkeypatch):
    nproc, flags = launch_flags(script)
    monkeypatch.setenv("WORLD_SIZE", str(nproc))
    assert not any(re.match(r"^\$", f) for f in flags), flags  # every variable stood in
    run = parse_args(flags)
    assert run.data_parallel_size == 1  # one pipeline of all the script's processes
    assert run.parallel.pipeline_schedule == "decoupled"
