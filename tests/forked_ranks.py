"""Launch a test's processes as forks of one process that has already imported torch and
megatron-core, instead of `torchrun --standalone` or a fresh `python`.

A torchrun launch pays one interpreter, torch and megatron-core import (about 4 s on two
cores) for its agent and again for every rank, and the suite launches about 150 ranks. Here
one *zygote* process per test session imports them once; each rank is a fork of it that:

- gets torchrun's environment for its rank (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, a fresh TORCHELASTIC_RUN_ID, ...) with the TCP store
  hosted by the test process, as torchrun's agent hosts it; or, for one process without
  torchrun, the caller's environment only;
- runs the script as `python script args` would (`__main__`, sys.argv, sys.path[0] the
  script's directory and no current directory before it);
- writes its stdout and stderr to files of its own, returned concatenated in rank order;
- ends like an interpreter does: non-daemon threads joined, atexit handlers run, the
  exit status of SystemExit or 1 after a traceback (but without tearing the preloaded
  modules down, a second per rank);
- dies with the zygote, and the zygote kills its ranks when the test session ends.

As with torchrun, the first rank that fails takes the others down (SIGTERM, then SIGKILL
after a grace period: 5 s here, 30 s in torchrun) and the job's exit status is 1, with a
line naming the rank and its status. Keep torchrun itself for tests of torchrun's own
behaviour (a killed worker, the launch examples) and a fresh interpreter for what is
decided at import time (the C++ optimizer's environment knobs).

The zygote runs one thread and never touches torch before forking, so a fork is as clean
as a new process; the modules it preloads read no environment at import. Signals go
through the zygote, which sends them only to children it has not reaped: a pid that
has been reused is never signalled.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What every launched script imports first; a fork finds them loaded.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.utils.tensorboard",
           "megatron.core.optimizer_param_scheduler", "megatron.training.training")
# Every rank runs the device layer's stream sanitizer (docs/device-sanitizer.md) unless
# the caller's environment says otherwise: a wait missing in the runtime fails the test
# that runs it, whatever the timing. Its cost: a few microseconds per device operation.
RANK_DEFAULTS = {"MEGATRON_DEVICE_SANITIZER": "1"}
GRACE_S = 5.0  # after SIGTERM to the surviving ranks of a failed job, before SIGKILL
READY = "ready"
PR_SET_PDEATHSIG = 1


# --- the zygote (its own process) ---------------------------------------------------------

def zygote_main(preload: Sequence[str] = PRELOAD) -> None:
    """Preload, then serve request lines on stdin: fork a child (reporting its pid and,
    later, its exit status on stdout) or signal a child not reaped yet. At the end of its
    input it kills its children and exits. Returns only in a child, after setting it up:
    the caller then runs the request's script at the top level."""
    import warnings

    # the warnings a fresh `pretrain_llama.py` filters before its own imports
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    requests, responses = sys.stdin.fileno(), os.dup(sys.stdout.fileno())
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # nothing an import prints may reach the protocol
    os.close(quiet)
    for module in preload:
        __import__(module)
    _say(responses, READY)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([requests], [], [], 0.05)
        _report_exits(responses, children)
        if not readable:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:  # the test session is gone: so are its ranks
            _end(children)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "signal" in request:
                if request["pid"] in children:  # not reaped: still this pid's process
                    os.kill(request["pid"], request["signal"])
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(responses)
                _become(request)
                return
            children.add(pid)
            _say(responses, f"started {request['id']} {pid}")


def _say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _report_exits(responses: int, children: set[int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _say(responses, f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _end(children: set[int]) -> None:
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    os._exit(0)


def _become(request: dict) -> None:
    """In the forked child: the request's directory, environment, files and arguments."""
    import ctypes

    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the zygote
    if os.getppid() == 1:  # the zygote died before the line above
        os._exit(1)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads:  # libgomp read the zygote's environment when it was loaded
        import torch

        torch.set_num_threads(int(threads))
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # python -P keeps no cwd


def run_request_script() -> None:
    """The child's part: run sys.argv[0] as `__main__`, then end as an interpreter does
    (non-daemon threads joined, atexit handlers run, stdio flushed, the exit status of
    SystemExit, 1 after a traceback) but without tearing down the preloaded modules, which
    would take a second of every rank for nothing."""
    import atexit
    import runpy
    import threading

    code = 0
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what interpreter finalization does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _exit_status(code: object) -> int:
    """What the interpreter makes of SystemExit(code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# --- the test side ------------------------------------------------------------------------

class _Zygote:
    """The session's zygote process and the bookkeeping of the children it forked."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        code = (f"import sys; sys.path.insert(0, {ROOT!r}); import tests.forked_ranks as z; "
                f"z.zygote_main({tuple(preload)!r}); z.run_request_script()")
        self._errors = tempfile.TemporaryFile()  # what a failed preload printed
        # -P: no current directory on sys.path, as for `python script.py`
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", code], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._errors)
        self._buffer = b""
        self._started: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._next_id = 0
        self._ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _send(self, request: dict) -> None:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()

    def fork(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: str,
             stderr: str) -> int:
        self._wait_for(lambda: self._ready, 120, "to preload")
        self._next_id += 1
        rid = self._next_id
        self._send({"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd,
                    "stdout": stdout, "stderr": stderr})
        self._wait_for(lambda: rid in self._started, 60, "to fork")
        return self._started.pop(rid)

    def signal(self, pid: int, sig: int) -> None:
        """Signal `pid` if it has not exited (the zygote checks: it reaps its children)."""
        if self.alive() and pid not in self._exited:
            self._send({"pid": pid, "signal": int(sig)})

    def exit_code(self, pid: int) -> int | None:
        return self._exited.get(pid)

    def forget(self, pid: int) -> None:
        self._exited.pop(pid, None)

    def pump(self, timeout: float) -> None:
        """Read what the zygote reported within `timeout` seconds."""
        out = self.proc.stdout.fileno()
        readable, _, _ = select.select([out], [], [], timeout)
        if not readable:
            return
        chunk = os.read(out, 1 << 16)
        if not chunk:
            raise RuntimeError("the test zygote process died")
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            kind, *fields = line.decode().split()
            if kind == READY:
                self._ready = True
            elif kind == "started":
                self._started[int(fields[0])] = int(fields[1])
            elif kind == "exited":
                self._exited[int(fields[0])] = int(fields[1])

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or not self.alive():
                self._errors.seek(0)
                printed = self._errors.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"the test zygote process failed {what}:\n{printed}")
            self.pump(0.05)

    def close(self) -> None:
        """End the zygote; it kills the ranks still running."""
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._errors.close()


_ZYGOTE: _Zygote | None = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or not _ZYGOTE.alive():
        close_zygote()
        _ZYGOTE = _Zygote()
    return _ZYGOTE


def warm_up() -> None:
    """Start the session's zygote now (it preloads in the background; the first launch
    waits for it)."""
    _zygote()


def close_zygote() -> None:
    global _ZYGOTE
    if _ZYGOTE is not None:
        _ZYGOTE.close()
        _ZYGOTE = None


def torchrun_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What `torchrun --standalone --nproc-per-node nproc` gives worker `rank`: the TCP
    store at 127.0.0.1:`port` is the agent's (here: the test process's)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc),
            "WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _agent_store(nproc: int):
    """The job's TCP store, hosted here on a port the system picks (no port to race for)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=300))


class RankJob:
    """The ranks of one launch, running; `wait()` collects them like subprocess.run."""

    def __init__(self, script: str, args: Sequence[str], nproc: int, torchrun: bool,
                 env: Mapping[str, str], cwd: str) -> None:
        if nproc > 1 and not torchrun:
            raise ValueError("several processes need torchrun's environment")
        script = os.path.join(cwd, script)
        self.torchrun = torchrun
        base = {**RANK_DEFAULTS, **os.environ, **env}
        self.command = ([f"torchrun --nproc-per-node {nproc}"] if torchrun else ["python"]) \
            + [script, *args]
        self.pids: list[int] = []
        self._result: subprocess.CompletedProcess | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._store = _agent_store(nproc) if torchrun else None
        self._zygote = _zygote()
        self._logs = tempfile.TemporaryDirectory(prefix="ranks-")
        self._files = [(os.path.join(self._logs.name, f"{r}.out"),
                        os.path.join(self._logs.name, f"{r}.err")) for r in range(nproc)]
        try:
            run_id = env.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex  # --rdzv-id
            for rank, (out, err) in enumerate(self._files):
                rank_env = base
                if torchrun:
                    rank_env = {"OMP_NUM_THREADS": "1",  # torchrun's default for workers
                                **base, **torchrun_env(rank, nproc, self._store.port, run_id)}
                self.pids.append(self._zygote.fork([script, *args], rank_env, cwd, out, err))
        except BaseException:
            self._close()
            raise

    def running(self) -> bool:
        """Whether every rank is still running."""
        self._zygote.pump(0)
        return all(self._zygote.exit_code(pid) is None for pid in self.pids)

    def kill(self) -> None:
        """SIGKILL every rank still running and wait until they are gone (through the
        zygote: never a reused pid), e.g. a stopped rank once the others have ended."""
        _kill(self._zygote, self.pids, signal.SIGKILL)

    def wait(self, timeout: float = 300) -> subprocess.CompletedProcess:
        """Wait for every rank (returncode: 0; a single process's status; 1 when a rank of
        several failed, as torchrun); raise subprocess.TimeoutExpired after `timeout`
        seconds, every rank killed. Once it has returned or raised, it does so again."""
        if self._failure is not None:
            raise self._failure
        if self._result is not None:
            return self._result
        try:
            codes = _wait(self._zygote, self.pids, timeout, self.command)
            stdout = "".join(_read(out) for out, _ in self._files)
            stderr = "".join(_read(err) for _, err in self._files)
        except BaseException as exc:
            self._failure = exc
            raise
        finally:
            self._close()
        failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
        returncode = 0
        if failed and not self.torchrun:
            returncode = failed[0][1]
        elif failed:
            returncode = 1
            stderr += "".join(f"[forked_ranks] rank {rank} failed with exit status {code}\n"
                              for rank, code in failed)
        self._result = subprocess.CompletedProcess(self.command, returncode, stdout, stderr)
        return self._result

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _kill(self._zygote, self.pids, signal.SIGKILL)
        finally:
            for pid in self.pids:
                self._zygote.forget(pid)
            self._logs.cleanup()
            self._store = None


def start(script: str, args: Sequence[str], nproc: int = 1, *, torchrun: bool | None = None,
          env: Mapping[str, str] | None = None, cwd: str = ROOT) -> RankJob:
    """Start `torchrun --standalone --nproc-per-node nproc script args` (`torchrun`
    defaults to nproc > 1) or `python script args` on forks of the zygote."""
    return RankJob(script, args, nproc, nproc > 1 if torchrun is None else torchrun,
                   env or {}, cwd)


def launch(script: str, args: Sequence[str], nproc: int = 1, *, torchrun: bool | None = None,
           env: Mapping[str, str] | None = None, timeout: float = 300,
           cwd: str = ROOT) -> subprocess.CompletedProcess:
    """start(...).wait(timeout)."""
    return start(script, args, nproc, torchrun=torchrun, env=env, cwd=cwd).wait(timeout)


def _wait(zygote: _Zygote, pids: list[int], timeout: float, command: list[str]) -> list[int]:
    """Every rank's exit status; on the first failure, the others are taken down as
    torchrun does (a failed rank's survivors are SIGKILLed after the grace period)."""
    deadline = time.monotonic() + timeout
    failed = False
    while True:
        codes = [zygote.exit_code(pid) for pid in pids]
        if not failed and any(c not in (None, 0) for c in codes):
            failed = True
            _kill(zygote, pids, signal.SIGTERM)
            deadline = min(deadline, time.monotonic() + GRACE_S)
        if all(c is not None for c in codes):
            return codes
        if time.monotonic() > deadline:
            if failed:
                _kill(zygote, pids, signal.SIGKILL)
                continue
            raise subprocess.TimeoutExpired(" ".join(command), timeout)
        zygote.pump(0.05)


def _kill(zygote: _Zygote, pids: list[int], sig: int) -> None:
    if not zygote.alive():
        return
    zygote.pump(0)
    for pid in pids:
        zygote.signal(pid, sig)
    if sig == signal.SIGKILL:  # wait until they are gone: their files and segments too
        deadline = time.monotonic() + 30
        while any(zygote.exit_code(p) is None for p in pids) and time.monotonic() < deadline:
            zygote.pump(0.05)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def segments_left(job: str, timeout_s: float = 10.0) -> list[str]:
    """The shared-memory segments of `job` still there once its reapers have had
    `timeout_s` to run: a rank killed by a signal leaves its segments to its reaper, which
    removes them when it sees the rank gone, a moment after the rank's exit is reported."""
    import time

    from megatron.offload.param_store import job_segments

    deadline = time.monotonic() + timeout_s
    while (left := job_segments(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
