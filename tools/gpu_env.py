"""The environment of `make gpu-check`: the machine's own CUDA torch, never a pinned wheel.

    python3 tools/gpu_env.py [--venv .venv-gpu] [--wheels DIR] [--dry-run] [-- CHECK ARGS]

A GPU machine brings its torch (a CUDA build, often without network). This makes a venv
with `--system-site-packages` (so that torch is the machine's; when that python is itself a
venv, a .pth file adds that venv's site-packages), looks in it for what the check needs
(megatron-core at the version requirements.txt pins, pybind11 and setuptools to build the
C++ optimizer, pytest, ...), installs only what is missing, from the package index or, with
--wheels, only from that directory (`pip install --no-index --find-links DIR`; megatron-core
with --no-deps), builds the C++ optimizer in place, then runs tools/gpu_check.py in the venv.
torch is never installed: a constraints file pins the installed version for pip. When
nothing is missing pip is not run at all, so an offline machine is never asked for the
network. Exit 2, before anything is created, without torch or without a CUDA device.
--dry-run prints the commands instead of running them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_env.py"
# What the check's steps import, by distribution name; versions from requirements.txt where
# it names one. torch is deliberately absent: it is the machine's.
NEEDED = ("megatron-core", "numpy", "packaging", "pybind11", "setuptools", "pytest",
          "pytest-timeout", "psutil", "tokenizers")
NO_DEPS = ("megatron-core",)  # installed alone: its dependency on torch must not be resolved

# Run by the venv's (or the base) python: what it sees of torch, CUDA and the needed
# distributions, and whether it is itself a venv (then its site-packages are passed on).
PROBE = r"""
import importlib.metadata as md, json, site, sys
specs = json.loads(sys.argv[1])
found = {}
for name in specs:
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
if sys.argv[2] == "import":
    try:
        import torch
        torch_info = {"version": torch.__version__, "cuda": torch.version.cuda,
                      "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    except ImportError:
        torch_info = None
else:  # the dry run: the version without importing torch (seconds), the GPUs not counted
    try:
        torch_info = {"version": md.version("torch"), "cuda": None, "gpus": None}
    except md.PackageNotFoundError:
        torch_info = None
print(json.dumps({"found": found, "torch": torch_info,
                  "in_venv": sys.prefix != sys.base_prefix,
                  "site_packages": site.getsitepackages(),
                  "python": "%d.%d" % sys.version_info[:2]}))
"""


def requirement_specs(requirements: str, names: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """`names` with the version spec requirements.txt gives them ('megatron-core==0.16.1'),
    bare where it gives none."""
    listed: dict[str, str] = {}
    with open(requirements) as f:
        for line in f:
            spec = line.split("#", 1)[0].strip()
            match = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)$", spec)
            if match:
                listed[normalize(match.group(1))] = spec.replace(" ", "")
    return {name: listed.get(normalize(name), name) for name in names}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def satisfied(spec: str, version: str | None) -> bool:
    """Whether an installed `version` meets `spec`: exact pins compare, '>=' compares
    release numbers, a bare name only needs to be present."""
    if version is None:
        return False
    if "==" in spec:
        return version == spec.split("==", 1)[1]
    if ">=" in spec:
        return _release(version) >= _release(spec.split(">=", 1)[1])
    return True


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def probe(python: str, specs: dict[str, str], import_torch: bool = True) -> dict:
    """What `python` sees: the needed distributions' versions, torch (imported, so that the
    CUDA devices are counted, unless not `import_torch`), whether it is a venv."""
    out = subprocess.run([python, "-c", PROBE, json.dumps(list(specs)),
                          "import" if import_torch else "metadata"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def missing_specs(specs: dict[str, str], found: dict[str, str | None]) -> list[str]:
    return [spec for name, spec in specs.items() if not satisfied(spec, found.get(name))]


def install_commands(python: str, missing: list[str], wheels: str | None,
                     constraints: str) -> list[list[str]]:
    """pip commands for the missing specs: from `wheels` only when given, else the index;
    the no-deps ones alone; torch held at its installed version by `constraints`."""
    if not missing:
        return []
    source = ["--no-index", "--find-links", wheels] if wheels else []
    pip = [python, "-m", "pip", "install", "-q", *source, "--constraint", constraints]
    alone = [s for s in missing if normalize(re.split(r"[=<>!~]", s)[0]) in NO_DEPS]
    rest = [s for s in missing if s not in alone]
    return ([[*pip, "--no-deps", *alone]] if alone else []) + ([[*pip, *rest]] if rest else [])


def _run(command: list[str], parser: argparse.ArgumentParser,
         missing: list[str] | None = None) -> None:
    """`command` from the repository root; when it fails, one line after its own output."""
    status = subprocess.run(command, cwd=ROOT).returncode
    if status:
        hint = (f"; without network, give WHEELS=DIR holding wheels of: {' '.join(missing)}"
                if missing and " pip " in f" {' '.join(command)} " else "")
        parser.exit(1, f"{PROG}: error: `{shlex.join(command)}` failed (exit status "
                       f"{status}){hint}\n")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=".venv-gpu", help="the venv to make or reuse")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="install what is missing from this directory only (offline)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = p.parse_args(own)
    if args.wheels is not None:
        if not os.path.isdir(args.wheels):
            p.exit(2, f"{PROG}: error: --wheels {args.wheels}: not a directory\n")
        args.wheels = os.path.abspath(args.wheels)
    venv = os.path.abspath(args.venv)
    python = venv_python(venv)
    specs = requirement_specs(os.path.join(ROOT, "requirements.txt"))
    have_venv = os.path.exists(python)
    looked_at = python if have_venv else sys.executable
    try:
        seen = probe(looked_at, specs, not args.dry_run)
    except (OSError, subprocess.CalledProcessError) as error:
        p.exit(2, f"{PROG}: error: {looked_at}: cannot look into it ({error}); expected a "
                  f"working python (remove {venv} to make it again)\n")
    if seen["torch"] is None:
        p.exit(2, f"{PROG}: error: {python if have_venv else sys.executable} has no torch: "
                  "gpu-check uses the machine's CUDA torch, expected a python that imports it "
                  "(make gpu-check PYTHON=...)\n")
    if not seen["torch"]["gpus"] and not args.dry_run:
        p.exit(2, f"{PROG}: error: no CUDA device is visible (torch {seen['torch']['version']}"
                  f", CUDA build {seen['torch']['cuda']}): expected a GPU machine; without one,"
                  " `make test` is the whole check\n")
    commands: list[list[str]] = []
    writes: list[tuple[str, str]] = []
    if not have_venv:
        commands.append([sys.executable, "-m", "venv", "--system-site-packages", venv])
        if seen["in_venv"]:  # --system-site-packages reaches the base python's, not these
            pth = os.path.join(venv, "lib", f"python{seen['python']}", "site-packages",
                               "gpu-check-base-env.pth")
            writes.append((pth, "\n".join(seen["site_packages"]) + "\n"))
    constraints = os.path.join(venv, "torch-constraint.txt")
    missing = missing_specs(specs, seen["found"])
    if missing:
        writes.append((constraints, f"torch=={seen['torch']['version']}\n"))
    commands_after_writes = install_commands(python, missing, args.wheels, constraints)
    build = [python, "setup.py", "-q", "build_ext", "--inplace"]
    check = [python, os.path.join("tools", "gpu_check.py"), *check_args]
    if args.dry_run:
        print(f"# torch {seen['torch']['version']}: the machine's, never installed (the dry run "
              "does not look for a CUDA device)")
        for command in commands:
            print(shlex.join(command))
        for path, text in writes:
            print(f"write {path}: {' '.join(text.split())}")
        for command in [*commands_after_writes, build, check]:
            print(shlex.join(command))
        return 0
    for command in commands:
        _run(command, p)
    for path, text in writes:
        with open(path, "w") as f:
            f.write(text)
    for command in [*commands_after_writes, build]:
        _run(command, p, missing)
    os.chdir(ROOT)
    make = "make gpu-check" + (f" WHEELS={args.wheels}" if args.wheels else "")
    os.environ.setdefault("GPU_CHECK_COMMAND", make if "MAKELEVEL" in os.environ
                          else shlex.join([sys.executable, *sys.argv]))
    os.execv(python, check)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
