# Two commands for a fresh machine: `make demo` and `make test` (both create .venv on first use).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
OUT     := out/demo
export OMP_NUM_THREADS ?= 1
# bytecode is cached in .venv on first import (pip installs with --no-compile, below): an environment that sets
# PYTHONDONTWRITEBYTECODE would recompile torch's ~2,000 imported modules in every process (6 s instead of 3 s)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test test-gpu check venv clean


venv: $(STAMP)

# torch first, pinned: a loose range would pull gigabytes of CUDA wheels. constraints.txt keeps the pin while the
# extras go in, so pip never replaces torch: test (pytest, notebooks, transformers for hf: models) and export
# (Megatron-Core, DeepSpeed, Accelerate, torchtitan's config classes; ~100 MB, seconds), which validates exports.
# --no-compile: Python compiles a module's bytecode on its first import (into the venv), so only what runs is
# compiled -- byte-compiling every installed file took 1.5 of the 2.6 minutes the venv took. The last step compiles
# what every launch imports (a few seconds), so `.venv/bin/python` run outside make, in an environment that sets
# PYTHONDONTWRITEBYTECODE, still finds torch's bytecode.
$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -c constraints.txt -e '.[test,export]'
	$(BIN)/pip install -q --no-compile -c constraints.txt --no-deps torchtitan==0.3.0
	$(BIN)/python -c "import torch.distributed.checkpoint, torch.distributed.fsdp, torch.distributed.run"
	touch $(STAMP)

# profile -> plan -> launch -> show on the small built-in default (gpt:tiny), on this machine's CPU.
demo: $(STAMP)
	@mkdir -p $(OUT)
	$(BIN)/stratagem profile model --model gpt:tiny --micro-batch 1,2,4 --seq 64 --tp 1,2 --out $(OUT)/gpt-tiny.json
	$(BIN)/stratagem profile cluster --nproc-per-node 2 --quick --out $(OUT)/local-cpu.json
	$(BIN)/stratagem plan --model gpt:tiny --model-profile $(OUT)/gpt-tiny.json --cluster $(OUT)/local-cpu.json \
	  --gpus 2 --global-batch 8 --seq 64 --out $(OUT)/plan.json
	$(BIN)/stratagem launch $(OUT)/plan.json --steps 5 --metrics $(OUT)/metrics.jsonl
	$(BIN)/stratagem show $(OUT)/plan.json --metrics $(OUT)/metrics.jsonl --html $(OUT)/report.html

# quality gates: lint (with complexity limits), formatting, types of the planner (pyproject.toml configures them)
check: $(STAMP)
	$(BIN)/ruff check planner runtime tests benchmarks tools fixtures conftest.py
	$(BIN)/ruff format --check planner runtime tests benchmarks tools fixtures conftest.py
	$(BIN)/mypy

# the quality gates run beside the tests, their output after the tests'; both must pass. The tests run in
# TEST_WORKERS pytest-xdist processes, one test file per worker at a time (module fixtures run once; most of a
# multi-process test is waiting, so two workers on two cores take 12-13 minutes where one takes 18)
TEST_WORKERS ?= 2
test: $(STAMP)
	@$(MAKE) --no-print-directory check > $(VENV)/check.log 2>&1 & gates=$$!; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=10 --cpu-top 25; tests=$$?; \
	wait $$gates; checks=$$?; cat $(VENV)/check.log; \
	if [ $$checks -ne 0 ]; then echo "make check failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$checks -eq 0 ]

# GPU checks on a CUDA machine (tests marked gpu; `make test` skips them without CUDA). They need a CUDA build of
# torch, which .venv's pinned CPU wheel is not: GPU_PY names an interpreter that has one (and the deps).
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -q -m gpu tests/test_gpu.py

clean:
	rm -rf $(VENV) out
