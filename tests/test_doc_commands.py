"""Every command the README and docs/*.md show runs as shown, so that none can drift from
the code; figures quoted beside a command are the ones it prints.

Each `sh` block runs in a scratch directory that links the repository's files (what a
command writes stays out of the checkout). How, in short (docs/running.md says it for
readers, "How the commands in these pages are tested"):

- `python`/`torchrun` commands run as written, their ranks forked from the session's
  preloaded process with torchrun's environment (tests/forked_ranks.py), not a fresh
  interpreter per rank: the whole module stays within seconds per command.
- `make TARGET VAR=...` runs the commands `make -n TARGET VAR=...` prints; `make test` is
  this suite, so only its dry run is checked, and a `pytest` line only collects its
  selection. Anything else (mkdir, echo, a line with a pipe or a substitution) runs in
  bash.
- A pretrain_llama.py training command without `--train-iters` trains 2 iterations, and
  without `--eval-iters` evaluates 1 batch where its data has a validation split.
- Inputs a user brings are stood in (STAND_INS); `# prints: TEXT` asserts the block's
  output contains TEXT; a block whose first line is `# needs: gpu-host` is what a user runs
  on a GPU machine (a whole `make gpu-check`, one of its steps, training on every GPU): the
  suite never runs it, not even under `-m cuda` (the check's cuda-tests step would nest a
  check in itself), and only checks that each `make` line's variables reach its recipe and
  that the scripts it names exist; `# needs: slurm` runs only where sbatch exists;
  `# needs: network` (the package index) only with MEGATRON_SYSX_NETWORK_TESTS=1.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from dataclasses import dataclass

import pytest

from tests import forked_ranks

pytestmark = pytest.mark.multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
SHELL_INFO = ("sh", "bash", "shell")
FENCE = re.compile(r"^( *)```(\S*)[^\n]*\n(.*?)^\1```", re.M | re.S)  # list items indent
NOT_LINKED = {".git", "runs", "data", "checkpoints", "logs", "tensorboard_logs", "ckpt"}
# Flags that give a run a validation split: there, a training command without
# --eval-iters evaluates 1 batch instead of Megatron's default 100
VALIDATION_DATA = {"--data-path", "--split", "--valid-data-path"}
STAND_INS = ("owt.jsonl", "tok.json", "tokenizer_dir", "data/web", "data/code",
             "data/heldout", "Llama-2-7b-hf")
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")
NESTED = "MEGATRON_SYSX_DOC_COMMAND"  # set for the commands: their own test runs skip these
SHELL_SYNTAX = re.compile(r"\$\(|[|;&<>`]")  # what only a shell runs as written


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    text: str

    @property
    def needs(self) -> set[str]:
        first = self.text.lstrip().splitlines()[0] if self.text.strip() else ""
        m = re.match(r"#\s*needs:\s*(.*)", first)
        return {w.strip() for w in m.group(1).split(",")} if m else set()

    @property
    def prints(self) -> list[str]:
        return re.findall(r"^#\s*prints:\s*(.*\S)\s*$", self.text, re.M)

    def commands(self) -> list[str]:
        joined = self.text.replace("\\\n", " ")
        return [line for line in joined.splitlines()
                if line.strip() and not line.lstrip().startswith("#")]


def shell_blocks() -> list[Block]:
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for m in FENCE.finditer(text):
            if m.group(2) in SHELL_INFO:
                found.append(Block(page, text.count("\n", 0, m.start()) + 1,
                                   textwrap.dedent(m.group(3))))
    return found


NETWORK_ENV = "MEGATRON_SYSX_NETWORK_TESTS"


def _param(block: Block):
    marks = []
    if "gpu-host" in block.needs:
        marks.append(pytest.mark.skip(reason="runs on a GPU machine by hand (make gpu-check "
                                             "and its steps): not in the suite"))
    if "slurm" in block.needs:
        marks.append(pytest.mark.skipif(shutil.which("sbatch") is None,
                                        reason="needs a Slurm cluster (sbatch)"))
    if "network" in block.needs:  # installs from the package index: minutes, not the suite's
        marks.append(pytest.mark.skipif(
            os.environ.get(NETWORK_ENV) != "1",
            reason=f"installs packages from the index: set {NETWORK_ENV}=1 to run it"))
    return pytest.param(block, marks=marks, id=f"{block.page}:{block.line}")


BLOCKS = shell_blocks()


# --- stand-ins for what a user brings ------------------------------------------------------

@pytest.fixture(scope="module")
def stand_ins(demo_cache, tmp_path_factory) -> str:
    """A directory holding STAND_INS, made from the session's demo corpus."""
    from megatron.data.demo_corpus import ensure_demo_corpus
    from megatron.data.indexed_dataset_writer import write_indexed_dataset
    from megatron.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("stand-ins")
    corpus = ensure_demo_corpus(cache_dir=demo_cache, log=lambda _: None)
    with open(corpus.corpus_path, encoding="utf-8") as src:
        lines = [line for _, line in zip(range(3000), src)]
    # 1000 documents: enough for a validation and a test split of 969,30,1
    (root / "owt.jsonl").write_text("".join(lines[:1000]), encoding="utf-8")
    shutil.copy(corpus.tokenizer_path, root / "tok.json")
    (root / "tokenizer_dir").mkdir()  # as save_pretrained writes it: with its eos token
    shutil.copy(corpus.tokenizer_path, root / "tokenizer_dir" / "tokenizer.json")
    (root / "tokenizer_dir" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    (root / "data").mkdir()
    tokenizer = load_tokenizer(corpus.tokenizer_path)
    texts = [json.loads(line)["text"] for line in lines]
    for name, part in (("web", texts[:1500]), ("code", texts[1500:2500]),
                       ("heldout", texts[2500:])):
        write_indexed_dataset(part, tokenizer, str(root / "data" / name), log=lambda _: None)
    return str(root)


def _hf_llama(directory: str) -> None:
    """A 2-layer LLaMA-2 as Hugging Face saves it (config.json, model.safetensors), with the
    demo tokenizer's vocabulary; written without importing transformers (seconds)."""
    import torch
    from safetensors.torch import save_file

    from megatron.models.llama import LlamaConfig
    from megatron.training.checkpoint_hf import hf_config_from_model

    cfg = LlamaConfig(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4,
                      num_query_groups=2, vocab_size=4096, seq_length=128)
    kv = cfg.hidden_size // cfg.num_attention_heads * cfg.num_query_groups
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
              "model.norm.weight": (cfg.hidden_size,),
              "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}"
        shapes.update({
            f"{layer}.self_attn.q_proj.weight": (cfg.hidden_size, cfg.hidden_size),
            f"{layer}.self_attn.k_proj.weight": (kv, cfg.hidden_size),
            f"{layer}.self_attn.v_proj.weight": (kv, cfg.hidden_size),
            f"{layer}.self_attn.o_proj.weight": (cfg.hidden_size, cfg.hidden_size),
            f"{layer}.mlp.gate_proj.weight": (cfg.ffn_hidden_size, cfg.hidden_size),
            f"{layer}.mlp.up_proj.weight": (cfg.ffn_hidden_size, cfg.hidden_size),
            f"{layer}.mlp.down_proj.weight": (cfg.hidden_size, cfg.ffn_hidden_size),
            f"{layer}.input_layernorm.weight": (cfg.hidden_size,),
            f"{layer}.post_attention_layernorm.weight": (cfg.hidden_size,)})
    generator = torch.Generator().manual_seed(0)
    os.makedirs(directory)
    save_file({name: torch.randn(shape, generator=generator) * 0.02
               for name, shape in shapes.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config_from_model(cfg), f)


def scratch_dir(tmp_path, stand_ins: str, block: Block) -> str:
    for name in os.listdir(ROOT):
        if name not in NOT_LINKED and not name.endswith("_cache"):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "data").mkdir()
    for name in STAND_INS:
        source = os.path.join(stand_ins, name)
        if name == "Llama-2-7b-hf":
            if name in block.text:
                _hf_llama(str(tmp_path / name))
            continue
        if name.startswith("data/"):
            for suffix in (".bin", ".idx"):
                os.symlink(source + suffix, str(tmp_path / name) + suffix)
        else:
            os.symlink(source, tmp_path / name)
    return str(tmp_path)


# --- running one command --------------------------------------------------------------------

def run_command(line: str, cwd: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    if re.search(r"\bpytest\b", line):  # a test run shown in the docs: its selection only
        return _bash(line.split(" #", 1)[0] + " --collect-only -q", cwd, env)
    if SHELL_SYNTAX.search(line.split(" #", 1)[0]):  # substitutions, pipes, redirections
        return _bash(line, cwd, env)
    words = shlex.split(line, comments=True)
    own_env = dict(env)
    while words and ENV_WORD.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        own_env[name] = value
    program = words[0] if words else ""
    if program in (".venv/bin/python", "python") and words[1].endswith(".py"):
        return _forked(words[1], words[2:], 1, False, cwd, own_env)
    if program in (".venv/bin/torchrun", "torchrun"):
        i, nproc = 1, 1
        while not words[i].endswith(".py"):
            if words[i] in ("--nproc-per-node", "--nproc_per_node"):
                nproc = int(words[i + 1])
                i += 1
            elif words[i] != "--standalone":
                raise AssertionError(f"{line}: torchrun option {words[i]} not handled here")
            i += 1
        return _forked(words[i], words[i + 1:], nproc, True, cwd, own_env)
    if program == "make":
        return _make(words[1:], cwd, own_env)
    return _bash(line, cwd, own_env)


def _bash(line: str, cwd: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1200)


def _forked(script: str, args: list[str], nproc: int, torchrun: bool, cwd: str,
            env: dict[str, str]) -> subprocess.CompletedProcess:
    trains = script.endswith("pretrain_llama.py") and not {
        "--plan", "--print-model-size", "--help"} & set(args)
    if trains and "--train-iters" not in args:
        args = [*args, "--train-iters", "2"]
    if trains and "--eval-iters" not in args and VALIDATION_DATA & set(args):
        args = [*args, "--eval-iters", "1"]
    return forked_ranks.launch(script, args, nproc, torchrun=torchrun, env=env, cwd=cwd,
                               timeout=300)


def _make_dry_run(arguments: list[str], cwd: str,
                  env: dict[str, str]) -> subprocess.CompletedProcess:
    """What `make -n ARGUMENTS` prints. -o: the setup stamp counts as done (setup is `make
    setup`'s business, not this test's). Under `make test` this runs as a sub-make, which
    would print "make[1]: Entering directory" into the recipe: the outer make's variables
    stay out, as in a user's shell."""
    env = {k: v for k, v in env.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.setup-stamp",
                           *arguments], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def _make(arguments: list[str], cwd: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    target = next(word for word in arguments if not ENV_WORD.match(word))
    dry = _make_dry_run(arguments, cwd, env)
    assert dry.returncode == 0, dry.stderr
    recipe = [line for line in dry.stdout.replace("\\\n", " ").splitlines() if line.strip()]
    assert not any("pip install" in line for line in recipe), \
        f"make {target}: .venv's setup is out of date here (make setup first): {recipe}"
    if target == "test":  # the suite this test belongs to
        assert any("ruff check" in line for line in recipe), recipe
        assert any("tests/run_suite.py" in line for line in recipe), recipe
        return dry
    results = [run_command(line, cwd, env) for line in recipe]
    failed = [r for r in results if r.returncode != 0]
    last = (failed or results)[-1]
    return subprocess.CompletedProcess(f"make {target}", last.returncode,
                                       "".join(r.stdout for r in results),
                                       "".join(r.stderr for r in results))


# --- the tests ------------------------------------------------------------------------------

def test_the_pages_have_shell_blocks_and_only_known_marks():
    assert len(BLOCKS) >= 10 and any(b.page == "README.md" for b in BLOCKS)
    for block in BLOCKS:
        assert block.needs <= {"gpu-host", "slurm", "network"}, \
            f"{block.page}:{block.line}: {block.needs}"
        for line in block.commands():
            assert "..." not in line, f"{block.page}:{block.line}: not runnable as shown: {line}"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_a_documented_block_runs_as_shown(block, tmp_path, stand_ins, demo_cache):
    if os.environ.get(NESTED):  # a documented command (make gpu-check) runs the suite
        pytest.skip("inside a documented command's own test run")
    cwd = scratch_dir(tmp_path, stand_ins, block)
    env = {**os.environ, "MEGATRON_SYSX_CACHE": demo_cache, "OMP_NUM_THREADS": "1",
           NESTED: "1"}
    output = ""
    for line in block.commands():
        result = run_command(line, cwd, env)
        output += result.stdout + result.stderr
        assert result.returncode == 0, (f"{block.page}:{block.line}: `{line}` exited "
                                        f"{result.returncode}:\n{output[-3000:]}")
    for text in block.prints:
        assert text in output, f"{block.page}:{block.line}: does not print {text!r}"
    if "make train" in block.text:  # the run says where its files went, and they are there
        for name in ("metrics.jsonl", "timeline.png", "trace.json"):
            assert f"runs/tiny/{name} (" in output
            assert os.path.getsize(os.path.join(cwd, "runs", "tiny", name)) > 0
        assert "run summary: iterations 1-2 of 2" in output


def test_what_a_gpu_machine_runs_is_well_formed():
    """The `# needs: gpu-host` blocks are not run here; each `make` line's variables change
    the recipe it prints (none is dropped on the way), and every script a line names exists."""
    blocks = [b for b in BLOCKS if "gpu-host" in b.needs]
    assert blocks
    for block in blocks:
        for line in block.commands():
            words = shlex.split(line, comments=True)
            where = f"{block.page}:{block.line}: {line}"
            if words[0] == "make":
                plain = [w for w in words[1:] if not ENV_WORD.match(w)]
                recipe = _make_dry_run(plain, ROOT, dict(os.environ))
                assert recipe.returncode == 0, f"{where}: {recipe.stderr}"
                for assignment in (w for w in words[1:] if ENV_WORD.match(w)):
                    given = _make_dry_run([*plain, assignment], ROOT, dict(os.environ))
                    assert given.returncode == 0 and given.stdout != recipe.stdout, \
                        f"{where}: {assignment} does not reach the recipe"
            for word in words:
                if word.endswith((".py", ".sbatch", ".sh")):
                    assert os.path.exists(os.path.join(ROOT, word)), f"{where}: no {word}"


def test_the_readme_quotes_only_figures_benchmarks_holds():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        benchmarks = f.read()
    table = readme.split("## Measured figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    figures = [figure for row in rows[1:] for figure in
               re.findall(r"\d+\.\d+", row.split("|")[2])]
    assert len(figures) >= 10
    missing = [f for f in figures if f not in benchmarks]
    assert not missing, missing
    assert len(readme.splitlines()) <= 160

