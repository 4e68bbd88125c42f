"""`make gpu-check` without a GPU: the driver's steps, report, verdict and exit statuses
(tools/gpu_check.py, with stand-in steps), the environment it prepares (tools/gpu_env.py:
the machine's torch, nothing fetched when nothing is missing), and megatron-core's baseline
(bench/mcore_baseline.py) at a tiny size on the CPU."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, ROOT)
import gpu_check  # noqa: E402
import gpu_env  # noqa: E402

from bench import mcore_baseline  # noqa: E402
from megatron.schedules.gpu_peaks import datasheet_peak_flops  # noqa: E402

pytestmark = pytest.mark.unit


def _python(code: str) -> tuple[str, ...]:
    return ("-c", code)


def _stand_in_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "gpu_names", lambda: ["Stand-in GPU"])


def test_without_a_cuda_device_it_says_so_in_one_line_and_writes_nothing(
        tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not out.exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase file="tests/test_x.py" name="test_ok" />
<testcase file="tests/test_x.py" name="test_losses[bf16]"><failure message="AssertionError: \
losses differ">def test_losses():
&gt;       assert a == b
E       AssertionError: losses differ
E       assert 2.5 == 2.4
</failure></testcase>
<testcase file="tests/test_x.py" name="test_import"><error message="ImportError: no x" />
</testcase>
<testcase file="tests/test_x.py" name="test_gpu"><skipped message="needs a CUDA GPU" /></testcase>
</testsuite></testsuites>"""


def test_a_failed_step_names_itself_and_the_others_still_run(tmp_path, capsys, monkeypatch):
    _stand_in_gpu(monkeypatch)
    monkeypatch.setattr(gpu_check, "GRACE_S", 0.5)
    # a step out of time is killed with the processes it started, in its process group or
    # in a session of their own
    sleeper = ("import subprocess, sys, time; sleep = [sys.executable, '-c', "
               "'import time; time.sleep(60)']; p = subprocess.Popen(sleep); "
               "q = subprocess.Popen(sleep, start_new_session=True); "
               "print('children', p.pid, q.pid, flush=True); time.sleep(60)")
    # a step that ends leaving a process behind fails, and the process is ended
    leaver = ("import subprocess, sys; q = subprocess.Popen([sys.executable, '-c', 'import "
              "time; time.sleep(60)'], start_new_session=True); print('left', q.pid); "
              "print('{}')")
    junit = tmp_path / "junit.xml"
    steps = (
        gpu_check.Step("fails", _python("import sys; print('boom'); sys.exit(3)"), 30, "json"),
        gpu_check.Step("hangs", _python(sleeper), 6, "json"),
        gpu_check.Step("garbled", _python("print('not json')"), 30, "json"),
        gpu_check.Step("figures", _python("print('{\"GBps\": 12.5}')"), 30, "json"),
        gpu_check.Step("tests", _python(f"import sys; open({str(junit)!r}, 'w').write("
                                        f"{JUNIT!r}); sys.exit(1)"), 30, "junit", str(junit)),
        gpu_check.Step("leaves", _python(leaver), 30, "json"),
    )
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)], steps) == 1
    report = json.loads(out.read_text())
    assert {"command", "date", "machine", "commit", "steps", "summary", "verdict"} <= set(report)
    assert report["machine"]["gpus"] == ["Stand-in GPU"] and report["machine"]["torch"]
    by_name = {s["step"]: s for s in report["steps"]}
    assert [s["step"] for s in report["steps"]] == [s.name for s in steps]
    assert by_name["fails"]["status"] == "failed (exit status 3)"
    assert "boom" in by_name["fails"]["output_tail"]
    assert by_name["hangs"]["status"] == "out of time (6 s)"
    assert by_name["garbled"]["status"] == "failed (no figures in its output)"
    assert by_name["figures"]["passed"] and by_name["figures"]["figures"] == {"GBps": 12.5}
    tests = by_name["tests"]
    assert tests["status"] == "failed (exit status 1)"
    assert {k: tests["figures"][k] for k in ("passed", "failed", "errors", "skipped")} == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1}
    failed, erred = tests["figures"]["failures"]
    assert failed["test"] == "tests/test_x.py::test_losses[bf16]"
    assert failed["message"].splitlines() == [
        "AssertionError: losses differ", "E       AssertionError: losses differ",
        "E       assert 2.5 == 2.4"]
    assert erred == {"test": "tests/test_x.py::test_import", "kind": "error",
                     "message": "ImportError: no x"}
    assert tests["figures"]["skip_reasons"] == ["tests/test_x.py::test_gpu: needs a CUDA GPU"]
    leaves = by_name["leaves"]
    assert leaves["status"] == "failed (left 1 process(es) running, killed)"
    left = int(leaves["output_tail"].split()[1])
    assert [p["pid"] for p in leaves["left_running"]] == [left]
    children = [int(pid) for pid in by_name["hangs"]["output_tail"].split()[1:3]]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in [*children, left]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in [*children, left]), "a step's process survived it"
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == report["verdict"]
    assert printed[-1].startswith(
        "gpu-check: FAILED (fails, hangs, garbled, tests, leaves): 1 of 6 steps")
    assert "  failure: tests/test_x.py::test_losses[bf16]: AssertionError: losses differ" in printed
    assert str(out) in printed[-1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_when_every_step_passes_the_exit_status_is_0(tmp_path, capsys, monkeypatch):
    _stand_in_gpu(monkeypatch)
    steps = (gpu_check.Step("ok", _python("print('{}')"), 30, "json"),)
    assert gpu_check.main(["--out", str(tmp_path / "r.json")], steps) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(
        "gpu-check: passed: 1 of 1 steps passed")


def test_the_summary_sets_the_decoupled_run_beside_megatron_core_and_the_plan():
    large = {"decoupled": {"iteration_s": {"median": 2.0}, "mfu": 0.15},
             "megatron_core": {"variants": {"none": {"iteration_s": {"median": 1.6}, "mfu": 0.19},
                                            "full": {"iteration_s": {"median": 2.5}, "mfu": 0.12}}}}
    steps = [{"step": "1.35B decoupled vs megatron-core", "figures": large, "passed": True},
             {"step": "hardware profile and plan", "passed": True,
              "figures": {"plan": {"predicted_iteration_s": 3.0}, "predicted_spread": 0.04}}]
    figures = gpu_check.summary(steps)
    assert figures["decoupled_over_megatron_core_none_recompute"] == pytest.approx(1.25)
    assert figures["decoupled_over_megatron_core_full_recompute"] == pytest.approx(0.8)
    assert figures["plan_predicted_over_measured"] == pytest.approx(1.5)
    assert figures["plan_predicted_spread_between_profiles"] == 0.04
    line = gpu_check.verdict(steps, ["H100"], figures, 300, "r.json")
    assert "1.35B decoupled 2.00 s/iteration against megatron-core 1.60 s none recompute " \
           "(x1.25), megatron-core 2.50 s full recompute (x0.80)" in line
    assert "\n" not in line and "attention" not in line  # no side names its kernel
    large["decoupled"]["attention_kernel"] = "flash"
    large["megatron_core"]["variants"]["none"]["attention_kernel"] = "flash"
    large["megatron_core"]["variants"]["full"]["attention_kernel"] = "efficient"
    figures = gpu_check.summary(steps)
    assert figures["decoupled_attention_kernel"] == "flash"
    assert figures["megatron_core_full_recompute_attention_kernel"] == "efficient"
    assert "attention kernels differ: decoupled flash, megatron_core_none_recompute flash, " \
           "megatron_core_full_recompute efficient" in gpu_check.verdict(
               steps, ["H100"], figures, 300, "r.json")


def test_datasheet_peaks_by_the_name_cuda_reports():
    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert datasheet_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert datasheet_peak_flops("NVIDIA H200", "fp16") == 989e12
    assert datasheet_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert datasheet_peak_flops("NVIDIA L40S", "bf16") == 362e12
    assert datasheet_peak_flops("NVIDIA L4", "bf16") == 121e12
    assert datasheet_peak_flops("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 cores
    assert datasheet_peak_flops("Some Future GPU", "bf16") is None


def test_the_environment_installs_only_what_is_missing_and_never_torch(tmp_path):
    specs = gpu_env.requirement_specs(os.path.join(ROOT, "requirements.txt"))
    assert specs["megatron-core"].startswith("megatron-core==")  # the pinned version
    assert not any(gpu_env.machines_own(name) for name in specs)  # torch, triton, nvidia-*
    assert gpu_env.satisfied("megatron-core==0.16.1", "0.16.1")
    assert not gpu_env.satisfied("megatron-core==0.16.1", "0.15.0")
    assert gpu_env.satisfied("pybind11>=2.12", "2.13.6")
    assert not gpu_env.satisfied("pybind11>=2.12", "2.11.1") and not gpu_env.satisfied("x", None)
    pip = ["py", "-m", "pip"]
    assert gpu_env.install_commands(pip, [], "wheels", "c.txt") == []  # no pip, no network
    installed = {name: spec.split("==")[1] if "==" in spec else "99"
                 for name, spec in specs.items()}
    missing = gpu_env.missing_specs(specs, {**installed, "megatron-core": None,
                                            "pybind11": None, "tokenizers": None})
    assert missing == [specs["megatron-core"], specs["pybind11"], specs["tokenizers"]]
    offline = gpu_env.install_commands(pip, missing, "wheels", "c.txt")
    install = [*pip, "install", "-q", "--disable-pip-version-check", "--no-input",
               "--no-index", "--find-links", "wheels", "--constraint", "c.txt"]
    assert offline == [[*install, "--no-deps", specs["megatron-core"], specs["tokenizers"]],
                       [*install, specs["pybind11"]]]
    online = gpu_env.install_commands(pip, missing, None, "c.txt")
    assert all("--no-index" not in c and "--constraint" in c for c in online)


def test_pip_is_the_machines_where_the_venv_sees_it_else_the_wheel_folders(tmp_path):
    assert gpu_env.pip_runner("venv/bin/python", "24.0", None) == ["venv/bin/python", "-m", "pip"]
    assert gpu_env.pip_runner("venv/bin/python", None, str(tmp_path)) is None
    (tmp_path / "pip-26.3-py3-none-any.whl").write_bytes(b"")
    assert gpu_env.pip_runner("venv/bin/python", None, str(tmp_path)) == [
        "venv/bin/python", str(tmp_path / "pip-26.3-py3-none-any.whl" / "pip")]


def test_the_wheel_folder_is_the_one_list_for_the_gpu_machines_python():
    command = gpu_env.download_command("dir", "3.12", "manylinux_2_28_x86_64")
    specs = gpu_env.requirement_specs(os.path.join(ROOT, "requirements.txt"))
    assert command[command.index("dir") + 1:] == [*specs.values(), "pip"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(command)
    assert command[command.index("--python-version") + 1] == "3.12"
    platforms = [command[i + 1] for i, word in enumerate(command) if word == "--platform"]
    assert platforms[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in platforms
    assert {"manylinux2014_x86_64", "manylinux1_x86_64"} <= set(platforms)
    assert "manylinux_2_29_x86_64" not in platforms


def _wheel(directory, name: str, version: str, requires: list[str]) -> None:
    import zipfile

    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", "".join(
            [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             *(f"Requires-Dist: {r}\n" for r in requires)]))


def test_a_wheel_folder_that_would_not_install_offline_is_named_what_it_lacks(tmp_path):
    _wheel(tmp_path, "pytest", "9.2.0", ["pluggy<2,>=1.6", "iniconfig>=2",
                                         'tomli>=2; python_version < "3.11"',
                                         'colorama; sys_platform == "win32"',
                                         'hypothesis; extra == "dev"'])
    _wheel(tmp_path, "pluggy", "1.5.0", [])
    _wheel(tmp_path, "megatron_core", "0.16.1", ["torch>=2.6.0", "einops"])  # --no-deps
    assert gpu_env.unmet_requirements(str(tmp_path), "3.12", "manylinux_2_28_x86_64") == [
        "pytest 9.2.0 needs pluggy<2,>=1.6", "pytest 9.2.0 needs iniconfig>=2"]
    assert "pytest 9.2.0 needs tomli>=2" in gpu_env.unmet_requirements(
        str(tmp_path), "3.10", "manylinux_2_28_x86_64")


def test_make_gpu_check_dry_run_keeps_the_machines_torch_and_prints_the_budget(tmp_path):
    venv = tmp_path / "venv"
    proc = subprocess.run(
        ["make", "-s", "gpu-check", "DRY_RUN=1", f"PYTHON={sys.executable}",
         f"GPU_VENV={venv}", f"WHEELS={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert any(line.endswith(f"-m venv --without-pip --system-site-packages {venv}")
               for line in lines)
    for line in lines:  # whatever this machine lacks: from the wheels, never torch
        if " pip install " in line:
            assert f"--no-index --find-links {tmp_path}" in line
            assert not any(word.split("=")[0] == "torch" for word in line.split())
    commands = [line for line in lines if not line.startswith("#")]
    assert commands[-2] == (f"{venv}/bin/python setup.py -q build_ext --inplace -j "
                            f"{len(os.sched_getaffinity(0))}")
    assert commands[-1] == f"{venv}/bin/python tools/gpu_check.py --out runs/gpu-check/report.json"
    budget = [line[len("#   "):] for line in lines if line.startswith("#   ")]
    steps = gpu_check.default_steps("work")
    assert budget == gpu_check.time_plan(steps)
    for step in steps:
        assert any(line.startswith(step.name) and f"{step.timeout_s:.0f} s" in line
                   for line in budget)
    total = gpu_check.SETUP_BUDGET_S + sum(step.timeout_s for step in steps)
    assert budget[-1].split()[1:4] == [f"{total:.0f}", "s", "="]
    assert not venv.exists()


def test_a_check_refuses_to_start_inside_a_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(gpu_check.INSIDE, "1")
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "started inside a gpu-check" in err[0] and not out.exists()
    with pytest.raises(SystemExit) as exit_:
        gpu_env.main(["--venv", str(tmp_path / "venv"), "--dry-run"])
    assert exit_.value.code == 2 and not (tmp_path / "venv").exists()
    assert "a check does not run itself" in capsys.readouterr().err


def test_list_probes_the_device_and_names_the_steps_and_their_limits(capsys, monkeypatch):
    _stand_in_gpu(monkeypatch)
    assert gpu_check.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpu-check: Stand-in GPU; torch ")
    assert f"commit: {gpu_check.commit()}" in out
    for line in gpu_check.time_plan(gpu_check.default_steps("work")):
        assert f"  {line}\n" in out


def test_the_commit_is_unknown_without_git_and_in_an_archive(tmp_path, monkeypatch):
    assert len(gpu_check.commit().split("+")[0]) == 40  # this checkout's HEAD
    outer = tmp_path / "outer"  # a repository with a commit, around an unpacked archive
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.name=x", "-c", "user.email=x@x",
                    "commit", "-q", "--allow-empty", "-m", "outer"], check=True)
    (outer / "project" / "tools").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tools", "gpu_check.py"), outer / "project" / "tools")
    archive = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tools'); "
                              "import gpu_check; print(gpu_check.commit())"],
                             cwd=outer / "project", capture_output=True, text=True)
    assert archive.stdout.strip() == "unknown", archive.stderr
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert gpu_check.commit() == "unknown"


def test_the_cuda_tests_step_runs_the_modules_that_hold_cuda_tests():
    files = gpu_check.cuda_test_files()
    assert {"tests/test_cuda_pipeline.py", "tests/test_device.py"} <= set(files)
    assert "tests/test_doc_commands.py" not in files  # its GPU blocks are not cuda tests
    step = gpu_check.default_steps("work")[0]
    assert step.argv[:4] == ("-m", "pytest", "-m", "cuda")
    assert step.argv[-len(files):] == tuple(files)
    assert f"--junitxml={step.junit}" in step.argv


def test_megatron_core_baseline_trains_the_model_on_the_cpu(capsys):
    assert mcore_baseline.main([
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "160",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--iters", "2",
        "--vocab-size", "512"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["model"]["vocab_size"] == 512
    none = result["variants"]["none"]
    assert len(none["iteration_times_s"]) == 2 and none["iteration_s"]["median"] > 0
    losses = none["losses"]  # the warm-up's and the 2 timed iterations'
    assert losses[0] == pytest.approx(math.log(512), rel=0.02)  # near-uniform at init
    assert losses[-1] < losses[0]
    # torch SDPA without TE, as our model's; bf16 with grouped-query attention on the CPU
    # device layer playing its default GPU (sm80): flash, as in a decoupled run
    assert result["attention_kernel"] == "flash"


def test_megatron_core_baseline_refuses_full_recompute_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exit_:
        mcore_baseline.parse_args(["--num-layers", "2", "--hidden-size", "64",
                                   "--ffn-hidden-size", "160", "--num-attention-heads", "4",
                                   "--seq-length", "32", "--micro-batch-size", "2",
                                   "--global-batch-size", "4", "--device", "cpu",
                                   "--recompute", "none,full"])
    assert exit_.value.code == 2
    assert "--recompute full: megatron-core's full recompute needs CUDA" in capsys.readouterr().err


def test_the_check_covers_every_schedule_within_7_5_minutes_with_setup():
    import gpu_check_steps

    from megatron.schedules.generators import SCHEDULE_NAMES
    from tests.test_cuda_pipeline import CASES

    schedules = {"single", *SCHEDULE_NAMES}
    assert set(gpu_check_steps.SCHEDULE_FLAGS) == schedules  # under the sanitizer
    assert schedules <= set(CASES)  # against the CPU device layer
    steps = gpu_check.default_steps("work")
    assert gpu_check.SETUP_BUDGET_S + sum(step.timeout_s for step in steps) <= 7.5 * 60


def test_large_adds_the_7b_step_after_the_default_ones(tmp_path, monkeypatch):
    _stand_in_gpu(monkeypatch)
    ran = []

    def record(step):
        ran.append(step.name)
        return {"step": step.name, "passed": True, "status": "passed", "seconds": 0.0,
                "figures": {}}
    monkeypatch.setattr(gpu_check, "run_step", record)
    defaults = [s.name for s in gpu_check.default_steps("work")]
    assert gpu_check.main(["--out", str(tmp_path / "r.json")]) == 0
    assert ran == defaults  # not in the default run (its 8 minutes)
    ran.clear()
    assert gpu_check.main(["--out", str(tmp_path / "r.json"), "--large"]) == 0
    assert ran == [*defaults, gpu_check.LARGE_MODEL_STEP]


def test_the_7b_step_plans_then_trains_what_fits_one_h100_with_128_gib(tmp_path, capsys):
    """Its dry run prints the plan and the run; the plan's flags fit the one-GPU profile."""
    import gpu_check_steps

    from megatron.training.training import main as pretrain

    assert gpu_check_steps.main(["large-model", "--workdir", str(tmp_path), "--dry-run"]) == 0
    plan, train = capsys.readouterr().out.strip().splitlines()
    assert not os.listdir(tmp_path)  # ran nothing, wrote nothing
    flags = plan.split()[2:]  # after the interpreter and pretrain_llama.py
    run_flags = flags[:flags.index("--plan")]
    assert train.split()[2:2 + len(run_flags)] == run_flags  # the same run, trained
    assert "--train-iters 5" in train and "--plan" not in train
    assert pretrain(flags) == 0  # fits: the largest it names is at least this one
    out = json.loads(capsys.readouterr().out)
    assert out["largest_model"]["parameters"] >= 6.7e9


def test_the_7b_step_times_the_mean_of_iterations_3_to_5():
    import gpu_check_steps

    shape = gpu_check_steps.llama2_7b()
    metrics = [{"iteration": i, "iter_time_s": t} for i, t in
               enumerate([40.0, 15.0, 13.0, 14.0, 15.0], start=1)]
    figures = gpu_check_steps.timed_figures(metrics, shape, 16, 989e12)
    assert figures["iteration_s"] == {"mean": 14.0, "min": 13.0, "max": 15.0}
    # Megatron-LM 0.19's count: 6 flops per token and weight of the projections and the
    # logits (not the embedding lookup, not the norms), and the causal attention scores
    params, layers, hidden = shape.parameters(), shape.num_layers, shape.hidden_size
    weights = params.total - params.embedding - (2 * layers + 1) * hidden
    reference = (6 * weights + 6 * layers * hidden * shape.seq_length) * 16 * 4096 / 14.0
    assert figures["model_tflops"] == pytest.approx(reference / 1e12, rel=1e-12)
    assert figures["mfu"] == pytest.approx(figures["model_tflops"] / 989, rel=1e-9)
    assert figures["meets_target"] is False  # about 201 TFLOP/s; 250 needs about 11 s
    with pytest.raises(ValueError, match="iterations 3-5"):
        gpu_check_steps.timed_figures(metrics[:4], shape, 16, None)


def test_when_the_check_dies_its_steps_processes_end_with_it(tmp_path):
    """The watcher of a step gets SIGTERM when the check that started it is killed (even
    with SIGKILL), and ends what the step started, sessions of their own included."""
    status = tmp_path / "status.json"
    step = ("import subprocess, sys, time; q = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)'], start_new_session=True); "
            "print(q.pid, flush=True); time.sleep(60)")
    check = ("import subprocess, sys; subprocess.Popen([sys.executable, sys.argv[1], "
             "'--timeout', '60', '--grace', '0.5', '--status', sys.argv[2], '--', "
             "sys.executable, '-c', sys.argv[3]], start_new_session=True); "
             "import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", check,
                             os.path.join(ROOT, "tools", "process_tree.py"), str(status), step],
                            stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    proc.kill()  # SIGKILL: no clean-up of its own
    proc.wait()
    deadline = time.monotonic() + 10
    while not status.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    outcome = json.loads(status.read_text())
    assert outcome["interrupted"] and outcome["returncode"] is None
    assert not _alive(grandchild)
    proc.stdout.close()
