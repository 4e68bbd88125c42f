"""`make gpu-check` rehearsed on the CPU, on a machine made as bare as an offline GPU node:
everything before the GPU works has to work the first time there.

The GPU node (docs/gpu-validation.md): a python that is itself a venv holding the machine's
CUDA torch and pip, no `ensurepip`, no git, no network, maybe none of tensorboard,
transformers, sentencepiece; megatron-core never. Here: this interpreter copied with a
standard library that lacks `ensurepip`, a venv of it (--without-pip) holding a stand-in
torch that reports CUDA 13.0 and one device, the project copied as an unpacked archive
(no .git of its own, inside another repository), PATH without git, the network cut
(`unshare -n` where permitted, else pip held to an address where nothing listens), and a
wheel folder made by `tools/gpu_env.py --download-wheels` for this Python. `make gpu-check
ARGS=--list` then has to make the venv, install from the folder, run the C++ build (the
copy's objects are up to date: it compiles nothing, see the docs) and have
tools/gpu_check.py probe the device and list the steps. A second case takes away the pip
too (pip runs from its wheel). And the cuda-tests step's modules collect with tensorboard,
transformers and sentencepiece unimportable.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402
import gpu_env  # noqa: E402

pytestmark = pytest.mark.multiproc

WHEELS_ENV = "MEGATRON_SYSX_GPU_WHEELS"  # a folder made by --download-wheels, used as given
UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Network is unreachable",
               "Temporary failure in name resolution", "Could not fetch URL",
               "connection refused", "Name or service not known")
OPTIONAL = ("tensorboard", "transformers", "sentencepiece")
STAND_IN_GPU = "Stand-in GPU (rehearsal)"
STAND_IN_TORCH = '''"""A stand-in for the machine's CUDA torch: what gpu_env.py's probe and gpu_check.py's
device probe ask, nothing else (it cannot compute)."""
__version__ = "2.11.0+cu130"


class version:
    cuda = "13.0"


class cuda:
    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def get_device_name(index=0):
        return "{STAND_IN_GPU}"
'''.replace("{STAND_IN_GPU}", STAND_IN_GPU)
PYTHON_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"
NOT_COPIED = {".git", ".venv", ".venv-gpu", "runs", "build", "data", "checkpoints",
              "gpu-wheels", "__pycache__", ".pytest_cache", ".ruff_cache"}


# --- the machine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> str:
    """The wheel folder for this Python, made as `make gpu-wheels` makes the GPU node's:
    once per test session (in its cache directory), skipped only without the index."""
    if os.environ.get(WHEELS_ENV):
        return os.path.abspath(os.environ[WHEELS_ENV])
    cache = os.environ.get("MEGATRON_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    folder = os.path.join(cache, f"gpu-wheels-cp{PYTHON_VERSION.replace('.', '')}")
    if not glob.glob(os.path.join(folder, "*.whl")):
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_env.py"),
                               "--download-wheels", folder, "--python-version", PYTHON_VERSION],
                              capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        if proc.returncode and any(word.lower() in output.lower() for word in UNREACHABLE):
            pytest.skip(f"the package index is unreachable: {output.strip().splitlines()[-1]}")
        assert proc.returncode == 0, output
        assert "gpu-wheels: " in proc.stdout and "make gpu-check WHEELS=" in proc.stdout
    return folder


def _bare_interpreter(directory: str) -> str:
    """This interpreter, copied, over a standard library without ensurepip (as a Debian or
    NVIDIA image's python without python3-venv) and with empty site-packages."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lib = os.path.join(directory, "lib", os.path.basename(stdlib))
    os.makedirs(lib)
    for name in os.listdir(stdlib):
        if name not in ("ensurepip", "site-packages"):
            os.symlink(os.path.join(stdlib, name), os.path.join(lib, name))
    os.mkdir(os.path.join(lib, "site-packages"))
    include = sysconfig.get_paths()["include"]  # the headers the C++ build asks for
    os.makedirs(os.path.join(directory, "include"))
    os.symlink(include, os.path.join(directory, "include", os.path.basename(include)))
    os.makedirs(os.path.join(directory, "bin"))
    python = os.path.join(directory, "bin", os.path.basename(os.path.realpath(sys.executable)))
    shutil.copy2(os.path.realpath(sys.executable), python)  # a copy: it finds this stdlib
    return python


def _site_packages(python: str) -> str:
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _stand_in_torch(site_packages: str) -> None:
    os.mkdir(os.path.join(site_packages, "torch"))
    with open(os.path.join(site_packages, "torch", "__init__.py"), "w") as f:
        f.write(STAND_IN_TORCH)
    info = os.path.join(site_packages, "torch-2.11.0+cu130.dist-info")
    os.mkdir(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")


def _link_distribution(name: str, site_packages: str) -> None:
    """`name` as installed in this test's environment, linked in (what the node already has)."""
    import importlib.metadata as md

    dist = md.distribution(name)
    top = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
    for entry in top:
        source = os.path.join(str(dist.locate_file("")), entry)
        if os.path.exists(source) and not entry.endswith("__pycache__"):
            os.symlink(source, os.path.join(site_packages, entry))


def _gpu_node(root: str, with_pip: bool) -> str:
    """The node's python, holding the stand-in torch, numpy and tokenizers: with pip, a
    venv of the bare interpreter (as there); without, the bare interpreter itself."""
    python = _bare_interpreter(os.path.join(root, "base"))
    if with_pip:
        subprocess.run([python, "-m", "venv", "--without-pip", os.path.join(root, "node-env")],
                       check=True)
        python = os.path.join(root, "node-env", "bin", "python")
    site_packages = _site_packages(python)
    for name in ("numpy", "tokenizers", *(["pip"] if with_pip else [])):
        _link_distribution(name, site_packages)
    _stand_in_torch(site_packages)
    return python


def _archive_in_a_repository(root: str) -> str:
    """The project as an unpacked archive inside a directory that is a git repository of its
    own, with the checkout's built C++ extensions (times kept) also where `build_ext` looks
    for them before it copies them in place: up to date, it compiles nothing."""
    outer = os.path.join(root, "outer")
    os.mkdir(outer)
    subprocess.run(["git", "init", "-q", outer], check=True)
    project = os.path.join(outer, "project")
    shutil.copytree(ROOT, project, symlinks=True, ignore=lambda d, names: [
        n for n in names if n in NOT_COPIED or n.endswith("_cache")])
    built = os.path.join(project, "build", f"lib.{sysconfig.get_platform()}-"
                         f"{sys.implementation.cache_tag}", "megatron", "optimizer")
    os.makedirs(built)
    for path in glob.glob(os.path.join(ROOT, "megatron", "optimizer", "*.so")):
        shutil.copy2(path, built)
    return project


def _path_without_git(root: str) -> str:
    """A PATH of make and the C/C++ compilers only."""
    directory = os.path.join(root, "bin")
    os.mkdir(directory)
    for tool in ("make", "gcc", "g++", "cc", "c++"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, os.path.join(directory, tool))
    return directory


def _offline(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A command prefix and environment without network: a network namespace of its own
    where permitted, else pip's index at an address where nothing listens."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"], env
    return [], {**env, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
                "PIP_TIMEOUT": "2"}


def _installed(python: str) -> dict:
    code = ("import importlib.metadata as md, importlib.util as u, json, sys, torch; "
            "names = json.loads(sys.argv[1]); found = {}\n"
            "for n in names:\n"
            "    try: found[n] = md.version(n)\n"
            "    except md.PackageNotFoundError: found[n] = None\n"
            "print(json.dumps({'found': found, 'torch': torch.__file__, 'optional': "
            "[m for m in json.loads(sys.argv[2]) if u.find_spec(m)]}))")
    out = subprocess.run([python, "-c", code, json.dumps(gpu_env.NEEDED), json.dumps(OPTIONAL)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _listing(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def _built_objects(project: str) -> dict[str, float]:
    return {p: os.path.getmtime(p)
            for p in glob.glob(os.path.join(project, "megatron", "optimizer", "*.so"))}


# --- the rehearsal ---------------------------------------------------------------------------

@pytest.mark.parametrize("node", ["venv-with-pip", "bare-without-pip"])
def test_make_gpu_check_gets_to_the_device_on_a_bare_offline_node(node, wheels, tmp_path):
    root = str(tmp_path)
    with_pip = node == "venv-with-pip"
    python = _gpu_node(root, with_pip)
    node_site = _site_packages(python)
    before = _listing(node_site)
    project = _archive_in_a_repository(root)
    objects = _built_objects(project)
    assert len(objects) == 2, "build the C++ optimizer first (make setup)"
    home = os.path.join(root, "home")
    os.mkdir(home)
    # PIP_COMPILE=0: pip leaves out byte-compiling what it installs (megatron-core,
    # setuptools, pygments: about 5 CPU-seconds per case), which no assertion reads and which
    # cannot fail an install (pip only warns)
    prefix, env = _offline({"PATH": _path_without_git(root), "HOME": home, "LANG": "C.UTF-8",
                            "PYTHONNOUSERSITE": "1", "PIP_CONFIG_FILE": os.devnull,
                            "PIP_COMPILE": "0", "TMPDIR": str(tmp_path)})
    venv = os.path.join(root, "venv-gpu")
    proc = subprocess.run([*prefix, shutil.which("make"), "-C", project, "gpu-check",
                           f"PYTHON={python}", f"GPU_VENV={venv}", f"WHEELS={wheels}",
                           "ARGS=--list"],
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # every step before the GPU works: the venv without ensurepip, pip offline from the
    # folder, the build, then the check's own device probe and its list of steps
    assert f"-m venv --without-pip --system-site-packages {venv}" in output
    assert f"--no-index --find-links {wheels}" in output
    assert (" -m pip install " in output) == with_pip  # else pip's wheel runs it
    assert f"{venv}/bin/python setup.py -q build_ext --inplace -j " in output
    assert f"gpu-check: {STAND_IN_GPU}; torch 2.11.0+cu130, CUDA 13.0; commit: unknown" in output
    for step in gpu_check.default_steps("work"):
        assert step.name in output
    assert "total" in output and "(at most 7.5)" in output
    installed = _installed(os.path.join(venv, "bin", "python"))
    assert all(installed["found"].values()), installed["found"]
    assert installed["torch"] == os.path.join(node_site, "torch", "__init__.py")  # the node's
    assert installed["optional"] == []
    assert _listing(node_site) == before  # nothing installed into the node's python
    assert _built_objects(project) == objects  # up to date: the rehearsal compiles nothing


def test_the_cuda_tests_collect_without_tensorboard_transformers_sentencepiece():
    """The cuda-tests step's own pytest command, collecting only, with those three made
    unimportable: every cuda test, nothing else, no collection error."""
    step = gpu_check.default_steps("work")[0]
    args = [a for a in step.argv[2:] if not a.startswith("--junitxml")]  # after -m pytest
    blocker = ("import sys\n"
               "class Unimportable:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               f"        if name.split('.')[0] in {OPTIONAL!r}:\n"
               "            raise ImportError(f'{name} is not installed here')\n"
               "sys.meta_path.insert(0, Unimportable())\n"
               "import pytest\n"
               "sys.exit(pytest.main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", blocker, *args, "--collect-only"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert any("test_cuda_pipeline.py::" in line for line in collected)
    assert not any("test_doc_commands.py::" in line for line in collected)
    assert "error" not in proc.stdout.splitlines()[-1]
