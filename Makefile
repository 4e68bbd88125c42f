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

.PHONY: setup train test lint clean bench gpu-check

setup: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -r requirements.txt
	$(PY) setup.py -q build_ext --inplace
	@touch $(STAMP)

# The tiny preset with the decoupled (SysX) schedule on $(NPROC) CPU processes, each playing
# one GPU; metrics and the measured timeline of the last iteration go to runs/tiny/.
train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) \
	    pretrain_llama.py --model-preset tiny --pipeline-schedule decoupled \
	    --metrics-file runs/tiny/metrics.jsonl --timeline runs/tiny/timeline.png \
	    --trace runs/tiny/trace.json $(ARGS)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# On a GPU machine, first (docs/gpu-validation.md): in $(GPU_VENV), made from $(PYTHON) with
# --system-site-packages so that torch is the machine's CUDA build (never the pinned CPU
# wheel), what is missing of megatron-core and the build and test tools (from the index, or
# offline from WHEELS=dir), the C++ optimizer, then the checks: one JSON report
# (runs/gpu-check/report.json) and a one-line verdict. DRY_RUN=1 prints the commands only.
GPU_VENV ?= .venv-gpu
WHEELS ?=
gpu-check:
	$(PYTHON) tools/gpu_env.py --venv $(GPU_VENV) $(if $(WHEELS),--wheels $(WHEELS)) \
	    $(if $(DRY_RUN),--dry-run) -- --out runs/gpu-check/report.json $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf build megatron/optimizer/*.so
