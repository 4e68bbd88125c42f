"""The environment of `make gpu-check`: the machine's own CUDA torch, never a pinned wheel.

    python3 tools/gpu_env.py [--venv .venv-gpu] [--wheels DIR] [--dry-run] [-- CHECK ARGS]
    python3 tools/gpu_env.py --download-wheels DIR [--python-version 3.12]
                             [--platform manylinux_2_28_x86_64]

A GPU machine brings its torch (a CUDA build, often without network). This makes a venv
with `--system-site-packages` and without pip (so that torch is the machine's, and a python
without `ensurepip` works; when that python is itself a venv, a .pth file adds that venv's
site-packages), looks in it for what the check needs (NEEDED: megatron-core at the version
requirements.txt pins, pybind11 and setuptools to build the C++ optimizer, pytest, ...),
installs only what is missing, from the package index or, with --wheels, only from that
directory (`pip install --no-index --find-links DIR`; megatron-core and tokenizers with
--no-deps), with the machine's pip (the venv sees it) or else pip's own wheel from DIR,
builds the C++ optimizer in place on every core, then runs tools/gpu_check.py in the venv.
torch is never installed: a constraints file pins the installed version for pip. When
nothing is missing pip is not run at all, so an offline machine is never asked for the
network. Exit 2, before anything is created, without torch, without a CUDA device, without
a pip where one is needed, without the Python headers or a compiler, or inside a check.
--dry-run prints the commands and the time budget instead of running them.

--download-wheels, on a machine with the index, fills DIR with exactly the wheels the check
may install (NEEDED and pip), for the GPU machine's Python version and platform (default:
CPython 3.12, manylinux x86-64), checks that they install offline together, and prints
their size and the command to run there.
"""

from __future__ import annotations

import argparse
import email.parser
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "gpu_env.py"
# What the check needs, by distribution, and what those need in turn: the one list of what
# is looked for, what is installed and what --download-wheels fetches (with pip's own wheel,
# for a python without pip). Versions from requirements.txt where it names one.
NEEDED = ("megatron-core", "numpy", "packaging", "pybind11", "setuptools", "pytest",
          "iniconfig", "pluggy", "pygments", "pytest-timeout", "psutil", "tokenizers")
# Installed alone: megatron-core depends on torch (the machine's); tokenizers on
# huggingface-hub, which it imports only to download a tokenizer (the check never does).
NO_DEPS = ("megatron-core", "tokenizers")
PIP = "pip"
MACHINES_OWN = ("torch", "triton", "nvidia-")  # never fetched, never installed
GPU_HOST_PYTHON = "3.12"
GPU_HOST_PLATFORM = "manylinux_2_28_x86_64"

# Run by the venv's (or the base) python: what it sees of torch, CUDA, pip and the needed
# distributions, whether it can build a C++ extension, and whether it is itself a venv (then
# its site-packages are passed on).
PROBE = r"""
import importlib.metadata as md, json, os, site, sys, sysconfig
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
try:  # a pip in a site-packages directory is one a venv made from here sees too
    import pip
    pip_version = pip.__version__ if any(
        os.path.abspath(pip.__file__).startswith(os.path.abspath(d) + os.sep)
        for d in site.getsitepackages()) else None
except ImportError:
    pip_version = None
include = sysconfig.get_paths()["include"]
print(json.dumps({"found": found, "torch": torch_info, "pip": pip_version,
                  "python_h": os.path.exists(os.path.join(include, "Python.h")),
                  "include": include,
                  "compilers": [(os.environ.get(v) or sysconfig.get_config_var(v) or d).split()[0]
                                for v, d in (("CC", "cc"), ("CXX", "c++"))],
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


def machines_own(name: str) -> bool:
    return any(normalize(name).startswith(own) for own in MACHINES_OWN)


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
    CUDA devices are counted, unless not `import_torch`), pip, the build's needs, whether it
    is a venv."""
    out = subprocess.run([python, "-c", PROBE, json.dumps(list(specs)),
                          "import" if import_torch else "metadata"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def missing_specs(specs: dict[str, str], found: dict[str, str | None]) -> list[str]:
    return [spec for name, spec in specs.items() if not satisfied(spec, found.get(name))]


def pip_runner(python: str, pip_seen: str | None, wheels: str | None) -> list[str] | None:
    """How pip runs for the venv: the machine's pip, which the venv sees (through
    --system-site-packages or the .pth), else pip's wheel in `wheels` (a wheel runs as a
    zip); None without either."""
    if pip_seen:
        return [python, "-m", "pip"]
    wheel = sorted(glob.glob(os.path.join(wheels, "pip-*.whl"))) if wheels else []
    return [python, os.path.join(wheel[-1], "pip")] if wheel else None


def install_commands(pip: list[str], missing: list[str], wheels: str | None,
                     constraints: str) -> list[list[str]]:
    """pip commands for the missing specs: from `wheels` only when given, else the index;
    the NO_DEPS ones alone; torch held at its installed version by `constraints`."""
    if not missing:
        return []
    source = ["--no-index", "--find-links", wheels] if wheels else []
    install = [*pip, "install", "-q", "--disable-pip-version-check", "--no-input", *source,
               "--constraint", constraints]
    alone = [s for s in missing if normalize(re.split(r"[=<>!~]", s)[0]) in NO_DEPS]
    rest = [s for s in missing if s not in alone]
    return (([[*install, "--no-deps", *alone]] if alone else [])
            + ([[*install, *rest]] if rest else []))


def build_command(python: str) -> list[str]:
    """The C++ optimizer, in place: its extensions at once, each one's files at once
    (setup.py's parallel compile), on every core this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [python, "setup.py", "-q", "build_ext", "--inplace", "-j", str(cores or 1)]


def _run(command: list[str], parser: argparse.ArgumentParser,
         missing: list[str] | None = None) -> None:
    """`command` from the repository root, shown first; when it fails, one line after its
    own output."""
    print(f"gpu-check setup: {shlex.join(command)}", flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    if status:
        hint = (f"; without network, give WHEELS=DIR holding wheels of: {' '.join(missing)} "
                "(make gpu-wheels makes one)" if missing and "install" in command else "")
        parser.exit(1, f"{PROG}: error: `{shlex.join(command)}` failed (exit status "
                       f"{status}){hint}\n")


def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


# --- --download-wheels -----------------------------------------------------------------------

def platform_tags(platform: str) -> list[str]:
    """`platform` and the older manylinux tags a machine that takes it takes too (pip does
    not widen manylinux_2_N by itself)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    newest, arch = int(match.group(1)), match.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return ([f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)]
            + [f"{name}_{arch}" for n, name in legacy.items() if n <= newest])


def download_command(directory: str, python_version: str, platform: str) -> list[str]:
    """pip download of exactly NEEDED (their versions as requirements.txt gives them) and
    pip, binary wheels only, for that Python and platform, no dependency resolution."""
    specs = [*requirement_specs(os.path.join(ROOT, "requirements.txt")).values(), PIP]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--python-version", python_version,
            "--implementation", "cp",
            *(word for tag in platform_tags(platform) for word in ("--platform", tag)),
            "-d", directory, *specs]


def _wheel_metadata(path: str) -> email.message.Message:
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist()
                    if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(wheel.read(name).decode())


def unmet_requirements(directory: str, python_version: str, platform: str) -> list[str]:
    """What the wheels in `directory` require on that Python and platform (extras aside)
    and the directory does not hold, as 'pytest 9.2.0 needs pluggy<2,>=1.6'; the NO_DEPS
    wheels are installed alone, torch is the machine's."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip, which ran the download, carries its own
        from pip._vendor.packaging.requirements import Requirement
    machine = re.search(r"(x86_64|aarch64|ppc64le|s390x|i686)$", platform)
    environment = {"python_version": python_version,
                   "python_full_version": python_version + ".0",
                   "implementation_name": "cpython", "platform_python_implementation": "CPython",
                   "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                   "platform_machine": machine.group(1) if machine else "", "extra": ""}
    metadata = [_wheel_metadata(p) for p in sorted(glob.glob(os.path.join(directory, "*.whl")))]
    held = {normalize(m["Name"]): m["Version"] for m in metadata}
    unmet = []
    for m in metadata:
        if normalize(m["Name"]) in NO_DEPS:
            continue
        for line in m.get_all("Requires-Dist") or []:
            need = Requirement(line)
            if need.marker is not None and not need.marker.evaluate(environment):
                continue
            name = normalize(need.name)
            if name == "torch" or (name in held and need.specifier.contains(
                    held[name], prereleases=True)):
                continue
            unmet.append(f"{m['Name']} {m['Version']} needs {need.name}{need.specifier}")
    return unmet


def download_wheels(directory: str, python_version: str, platform: str,
                    parser: argparse.ArgumentParser) -> int:
    """Fill `directory` with exactly the check's wheels (what was there before is replaced
    only once the new set is complete) and say how to use it."""
    if not re.fullmatch(r"3\.\d+", python_version):
        parser.exit(2, f"{PROG}: error: --python-version {python_version}: expected a CPython "
                       "version as MAJOR.MINOR, e.g. 3.12\n")
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".gpu-wheels-") as partial:
        command = download_command(partial, python_version, platform)
        print(shlex.join(command), flush=True)
        status = subprocess.run(command).returncode
        if status:
            parser.exit(1, f"{PROG}: error: pip download failed (exit status {status}): "
                           "expected a machine that reaches the package index\n")
        fetched = sorted(os.path.basename(p) for p in glob.glob(os.path.join(partial, "*.whl")))
        own = [name for name in fetched if machines_own(name.split("-")[0])]
        unmet = unmet_requirements(partial, python_version, platform)
        if own or unmet:
            parser.exit(1, f"{PROG}: error: the wheels would not install offline beside the "
                           f"machine's torch: {'; '.join(own + unmet)}; expected NEEDED in "
                           "tools/gpu_env.py to hold every dependency, and no torch, triton "
                           "or CUDA package\n")
        os.makedirs(directory, exist_ok=True)
        for old in glob.glob(os.path.join(directory, "*.whl")):
            os.remove(old)
        for name in fetched:
            os.replace(os.path.join(partial, name), os.path.join(directory, name))
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in fetched)
    shown = os.path.relpath(directory, ROOT) if directory.startswith(ROOT + os.sep) else directory
    print(f"gpu-wheels: {len(fetched)} wheels, {size / 1e6:.1f} MB in {shown} (CPython "
          f"{python_version}, {platform} and older); on the GPU machine, with {shown} beside "
          f"the project: make gpu-check WHEELS={shown}")
    return 0


# --- the environment -------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    check_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=".venv-gpu", help="the venv to make or reuse")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="install what is missing from this directory only (offline)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    p.add_argument("--download-wheels", default=None, metavar="DIR",
                   help="fill DIR with the wheels the check may install, for the GPU machine")
    p.add_argument("--python-version", default=GPU_HOST_PYTHON,
                   help="with --download-wheels: the GPU machine's Python (MAJOR.MINOR)")
    p.add_argument("--platform", default=GPU_HOST_PLATFORM,
                   help="with --download-wheels: the newest manylinux tag the GPU machine "
                        "takes (older ones are taken too)")
    args = p.parse_args(own)
    if args.download_wheels is not None:
        return download_wheels(args.download_wheels, args.python_version, args.platform, p)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gpu_check

    if os.environ.get(gpu_check.INSIDE):
        p.exit(2, f"{PROG}: error: started inside a gpu-check ({gpu_check.INSIDE}="
                  f"{os.environ[gpu_check.INSIDE]}): expected to be run alone; a check does "
                  "not run itself\n")
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
        p.exit(2, f"{PROG}: error: {looked_at} has no torch: gpu-check uses the machine's CUDA "
                  "torch, expected a python that imports it (make gpu-check PYTHON=...)\n")
    if not seen["torch"]["gpus"] and not args.dry_run:
        p.exit(2, f"{PROG}: error: no CUDA device is visible (torch {seen['torch']['version']}"
                  f", CUDA build {seen['torch']['cuda']}): expected a GPU machine; without one,"
                  " `make test` is the whole check\n")
    missing = missing_specs(specs, seen["found"])
    pip = pip_runner(python, seen["pip"], args.wheels)
    if missing and pip is None:
        p.exit(2, f"{PROG}: error: no pip to install {' '.join(missing)}: {looked_at} sees "
                  f"none and {'WHEELS=' + args.wheels if args.wheels else 'no WHEELS= was given'}"
                  " holds no pip wheel; expected one of them (make gpu-wheels puts pip's "
                  "wheel in its folder)\n")
    lacking = [c for c in seen["compilers"] if not shutil.which(c)]
    if not args.dry_run and (lacking or not seen["python_h"]):
        p.exit(2, f"{PROG}: error: cannot build the C++ optimizer: "
                  + ("; ".join([*(f"no {c} on PATH" for c in lacking),
                                *([] if seen["python_h"] else [f"no Python.h in {seen['include']}"])]))
                  + "; expected a C/C++ compiler and the Python headers (python3-dev)\n")
    commands: list[list[str]] = []
    writes: list[tuple[str, str]] = []
    if not have_venv:  # without pip: no ensurepip needed, pip is the machine's or the wheel's
        commands.append([sys.executable, "-m", "venv", "--without-pip",
                         "--system-site-packages", venv])
        if seen["in_venv"]:  # --system-site-packages reaches the base python's, not these
            pth = os.path.join(venv, "lib", f"python{seen['python']}", "site-packages",
                               "gpu-check-base-env.pth")
            writes.append((pth, "\n".join(seen["site_packages"]) + "\n"))
    constraints = os.path.join(venv, "torch-constraint.txt")
    if missing:
        writes.append((constraints, f"torch=={seen['torch']['version']}\n"))
    installs = install_commands(pip or [], missing, args.wheels, constraints)
    build = build_command(python)
    check = [python, os.path.join("tools", "gpu_check.py"), *check_args]
    if args.dry_run:
        print(f"# torch {seen['torch']['version']}: the machine's, never installed (the dry run "
              "does not look for a CUDA device)")
        for command in commands:
            print(shlex.join(command))
        for path, text in writes:
            print(f"write {path}: {' '.join(text.split())}")
        for command in [*installs, build, check]:
            print(shlex.join(command))
        steps = gpu_check.default_steps(os.path.join(ROOT, "runs", "gpu-check", "work"))
        large = gpu_check.large_steps("work") if "--large" in check_args else ()
        print("# time limits on one GPU with 16 cores:")
        for line in gpu_check.time_plan(steps, large):
            print(f"#   {line}")
        return 0
    for command in commands:
        _run(command, p)
    for path, text in writes:
        with open(path, "w") as f:
            f.write(text)
    for command in [*installs, build]:
        _run(command, p, missing)
    setup_s = time.monotonic() - started
    over = setup_s > gpu_check.SETUP_BUDGET_S
    print(f"gpu-check: setup {setup_s:.0f} s ({'over' if over else 'within'} its "
          f"{gpu_check.SETUP_BUDGET_S} s)", flush=True)
    os.chdir(ROOT)
    make = "make gpu-check" + (f" WHEELS={args.wheels}" if args.wheels else "")
    os.environ.setdefault("GPU_CHECK_COMMAND", make if "MAKELEVEL" in os.environ
                          else shlex.join([sys.executable, *sys.argv]))
    os.environ["GPU_CHECK_SETUP_S"] = f"{setup_s:.1f}"
    os.execv(python, check)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
