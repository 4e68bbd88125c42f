"""The Dockerfile keeps the base image's torch: NGC's PyTorch images ship pre-release torch
builds (2.6.0a0+...), which megatron-core's `torch>=2.6.0` does not admit, so a plain
`pip install -r requirements.txt` would replace that torch (and the apex and Transformer
Engine built against it) with a PyPI build. No docker here: its install lines are run
against this checkout's requirements.txt with pip's own resolver left out."""

import re
import subprocess
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parent.parent


def run_instruction() -> str:
    text = (ROOT / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, flags=re.M | re.S)
    [install] = [r for r in runs if "pip install" in r]
    return install.replace("\\\n", " ")


def test_a_pre_release_torch_does_not_satisfy_megatron_cores_requirement():
    # why the Dockerfile installs megatron-core without its dependencies
    assert not SpecifierSet(">=2.6.0").contains("2.6.0a0+ecf3bae40a", prereleases=True)


def test_the_image_installs_megatron_core_alone_and_every_other_requirement(tmp_path):
    install = run_instruction()
    commands = [c.strip() for c in install.split("&&")]
    # the requirements file it writes, made here from this checkout's requirements.txt
    base = tmp_path / "requirements-base.txt"
    write = next(c for c in commands if c.startswith("grep -v"))
    subprocess.run(write.replace("/tmp/requirements-base.txt", str(base)), shell=True,
                   cwd=ROOT, check=True)
    names = {line.split("==")[0].split(">=")[0].strip() for line in base.read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    wanted = {line.split("==")[0].split(">=")[0].strip()
              for line in (ROOT / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    assert "megatron-core" not in names and names == wanted - {"megatron-core"}
    no_deps = next(c for c in commands if "--no-deps" in c)
    pinned = subprocess.run(["bash", "-c", f"echo {no_deps.split('--no-deps', 1)[1]}"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    [pin] = [line.split()[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.startswith("megatron-core==")]
    assert pinned == [pin]  # the version requirements.txt pins
    with_deps = [c for c in commands if "pip install" in c and "--no-deps" not in c]
    assert all("megatron-core" not in c for c in with_deps)
