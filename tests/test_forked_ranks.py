"""The test launcher behaves like torchrun and like a fresh interpreter where the tests rely
on it: each rank's environment, a normal exit (atexit handlers, non-daemon threads), the
first failure taking the other ranks down, a timeout that leaves no rank behind."""

import json
import os
import subprocess
import textwrap
import time

import pytest

from tests import forked_ranks

pytestmark = pytest.mark.multiproc


def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie the zygote has not reaped yet
        return f.read().split()[2] == "Z"


def test_each_rank_gets_torchruns_environment_and_runs_as_main(tmp_path):
    script = _script(tmp_path, "env.py", """
        import json, os, sys
        preloaded = "torch" in sys.modules and "megatron.training.training" in sys.modules
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "EXTRA")
        print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv,
                          "name": __name__, "preloaded": preloaded,
                          "path": sys.path, "cwd": os.getcwd()}))
    """)
    run = forked_ranks.launch(script, ["--flag", "x"], 3, env={"EXTRA": "1"})
    assert run.returncode == 0, run.stderr
    ranks = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1", "2"]  # in rank order
    for r in ranks:
        env = r["env"]
        assert env["LOCAL_RANK"] == env["RANK"] and env["WORLD_SIZE"] == "3"
        assert env["LOCAL_WORLD_SIZE"] == "3" and env["OMP_NUM_THREADS"] == "1"
        assert env["EXTRA"] == "1" and int(env["MASTER_PORT"]) > 0
        assert r["argv"] == [script, "--flag", "x"] and r["name"] == "__main__"
        assert r["preloaded"] and r["cwd"] == forked_ranks.ROOT
        assert r["path"][0] == str(tmp_path) and "" not in r["path"]  # python script.py
    assert len({r["env"]["TORCHELASTIC_RUN_ID"] for r in ranks}) == 1  # one job
    alone = forked_ranks.launch(script, [], 1)
    assert json.loads(alone.stdout)["env"]["RANK"] is None  # python script.py: no launcher


def test_a_rank_ends_like_an_interpreter(tmp_path):
    script = _script(tmp_path, "exit.py", f"""
        import atexit, sys, threading, time
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").close())
        def late():
            time.sleep(0.3)
            open({str(tmp_path / "thread")!r}, "w").close()
        threading.Thread(target=late).start()
        print("bye", file=sys.stderr)
        sys.exit(7)
    """)
    run = forked_ranks.launch(script, [], 1)
    assert run.returncode == 7 and run.stderr == "bye\n"
    assert (tmp_path / "atexit").exists() and (tmp_path / "thread").exists()
    crash = _script(tmp_path, "crash.py", "raise ValueError('boom')\n")
    run = forked_ranks.launch(crash, [], 1)
    assert run.returncode == 1 and "ValueError: boom" in run.stderr.splitlines()[-1]


def test_the_first_failure_takes_the_other_ranks_down(tmp_path):
    script = _script(tmp_path, "fail.py", """
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(3)
        signal.signal(signal.SIGTERM, lambda *_: (print("terminated"), sys.exit(0)))
        time.sleep(60)
    """)
    run = forked_ranks.launch(script, [], 2)
    assert run.returncode == 1  # torchrun's status for a failed worker, which it names
    assert "rank 1 failed with exit status 3" in run.stderr
    # SIGTERM first, as torchrun sends: rank 0 ends in its handler, not after its sleep
    # (which would end it without a word)
    assert "terminated" in run.stdout


def test_a_timeout_kills_every_rank(tmp_path):
    script = _script(tmp_path, "hang.py", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    """)
    job = forked_ranks.start(script, [], 2)
    with pytest.raises(subprocess.TimeoutExpired):
        job.wait(timeout=1)
    assert all(_gone(pid) for pid in job.pids)
    with pytest.raises(subprocess.TimeoutExpired):  # asked again: the same answer, at once
        job.wait(timeout=60)


def test_ranks_end_with_the_zygote(tmp_path):
    """A session that ends (or dies) leaves no rank running."""
    zygote = forked_ranks._Zygote(preload=())  # what it preloads plays no part here
    try:
        script = _script(tmp_path, "sleep.py", "import time; time.sleep(600)\n")
        pid = zygote.fork([script], dict(os.environ), forked_ranks.ROOT,
                          str(tmp_path / "out"), str(tmp_path / "err"))
        assert not _gone(pid)
    finally:
        zygote.close()
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid)
