"""The demo corpus the multi-process tests train on: built once per test session, in the
background, while the one-process tests run on the other core.

conftest.py calls `start()` once collection has found tests that need it; `cache_dir()`
waits for the build and names the cache directory (also MEGATRON_TEST_CACHE, which the
launch helpers pass as --data-cache-dir). A rank that asks for the corpus before the build
is done waits on the corpus's own file lock, as concurrent users do. Where MEGATRON_TEST_CACHE
already names a directory (tests/run_suite.py gives its two sessions one), the session
builds there, or finds the corpus the other session built under that lock, and leaves the
directory to whoever made it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "MEGATRON_TEST_CACHE"
_BUILD = ("import sys; sys.path.insert(0, sys.argv[2]); "
          "from megatron.data.demo_corpus import ensure_demo_corpus; "
          "ensure_demo_corpus(sys.argv[1])")
_state: dict = {}


def start() -> None:
    """Create the session's cache directory and start building the corpus in it."""
    if _state:
        return
    given = os.environ.get(ENV)
    directory = given or tempfile.mkdtemp(prefix="megatron-test-cache-")
    os.makedirs(directory, exist_ok=True)
    os.environ[ENV] = directory
    log_path = os.path.join(directory, f"build-{os.getpid()}.log")  # one per session
    log = open(log_path, "w")  # noqa: SIM115 - closed by wait
    builder = subprocess.Popen([sys.executable, "-c", _BUILD, directory, ROOT], stdout=log,
                               stderr=subprocess.STDOUT, cwd=ROOT)
    _state.update(directory=directory, owned=not given, log_path=log_path, log=log,
                  builder=builder)


def cache_dir() -> str:
    """The session's cache directory, once the corpus in it is built."""
    start()
    builder = _state["builder"]
    if builder.wait() != 0:
        raise RuntimeError(f"building the demo corpus failed:\n{build_log()}")
    _state["log"].close()
    return _state["directory"]


def build_log() -> str:
    """What the build printed."""
    with open(_state["log_path"]) as f:
        return f.read()


def stop() -> None:
    """End the build if it still runs and remove the cache directory (one this session
    made)."""
    if not _state:
        return
    builder = _state["builder"]
    if builder.poll() is None:
        builder.kill()
        builder.wait()
    _state["log"].close()
    if _state["owned"]:
        shutil.rmtree(_state["directory"], ignore_errors=True)
        os.environ.pop(ENV, None)
    else:
        os.remove(_state["log_path"])
    _state.clear()
