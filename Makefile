# Two commands do everything from a fresh clone: `make train` and `make test`.
# Both depend on `make setup`, which is idempotent: it creates .venv once, installs the
# pinned torch first (an unpinned torch would pull a multi-GB CUDA build), then the rest,
# then builds the C++ CPU optimizer in place.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.setup-stamp
NPROC ?= 2

.PHONY: setup train test lint clean bench gpu-check gpu-wheels

setup: $(STAMP)

# One line per step before it starts (the slow ones say how long they take), so a quiet
# minute is never a hang.
$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h)
	@test -x $(PY) || { echo "setup 1/5: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "setup 2/5: upgrading pip"
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null && echo "setup 3/5: torch already installed" || \
	    { echo "setup 3/5: installing $(TORCH_SPEC) (the largest download: minutes)"; \
	      $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	@echo "setup 4/5: installing requirements.txt (megatron-core, pybind11, ...)"
	@$(PY) -m pip install -q -r requirements.txt
	@echo "setup 5/5: building the C++ optimizer (csrc/, about a minute on 2 cores)"
	@$(PY) setup.py -q build_ext --inplace
	@touch $(STAMP)
	@echo "setup: done ($(VENV))"

# The tiny preset with the decoupled (SysX) schedule on $(NPROC) CPU processes, each playing
# one GPU; metrics and the measured timeline of the last iteration go to runs/tiny/.
train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
	    pretrain_llama.py --model-preset tiny --pipeline-schedule decoupled \
	    --metrics-file runs/tiny/metrics.jsonl --timeline runs/tiny/timeline.png \
	    --trace runs/tiny/trace.json $(ARGS)

# The suite as two pytest sessions at once (tests/run_suite.py): the one-process tier, then
# the multi-process modules marked after_unit, beside the other multi-process tests.
# PYTEST_ARGS=...: one pytest session with them (a selection).
# -rfEs: one line per failed, erroring or skipped test (a skip with its reason: the cuda
# tests without a GPU, ...)
test: setup
	$(VENV)/bin/ruff check .
	$(PY) tests/run_suite.py $(PYTEST_ARGS)

# On a GPU machine, first (docs/gpu-validation.md): in $(GPU_VENV), made from $(PYTHON) with
# --system-site-packages and without pip (so that torch is the machine's CUDA build, never
# the pinned CPU wheel, and a python without ensurepip works), what is missing of
# megatron-core and the build and test tools (from the index, or offline from WHEELS=dir),
# the C++ optimizer on every core, then the checks: one JSON report
# (runs/gpu-check/report.json) and a one-line verdict. DRY_RUN=1 prints the commands and
# the time limits only; ARGS=--list probes the device and lists the steps.
GPU_VENV ?= .venv-gpu
WHEELS ?=
gpu-check:
	$(PYTHON) tools/gpu_env.py --venv $(GPU_VENV) $(if $(WHEELS),--wheels $(WHEELS)) \
	    $(if $(DRY_RUN),--dry-run) -- --out runs/gpu-check/report.json $(ARGS)

# On a machine that reaches the package index: the wheels `make gpu-check WHEELS=...` may
# install on an offline GPU machine (never torch or CUDA packages), for its Python version
# and platform (default CPython 3.12, manylinux x86-64), in $(GPU_WHEELS).
GPU_WHEELS ?= gpu-wheels
GPU_WHEELS_PYTHON ?= 3.12
GPU_WHEELS_PLATFORM ?= manylinux_2_28_x86_64
gpu-wheels:
	$(PYTHON) tools/gpu_env.py --download-wheels $(GPU_WHEELS) \
	    --python-version $(GPU_WHEELS_PYTHON) --platform $(GPU_WHEELS_PLATFORM)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf build megatron/optimizer/*.so
