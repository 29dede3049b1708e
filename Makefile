# Two commands for a fresh machine: `make demo` and `make test` (both create .venv on first use).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
OUT     := out/demo
export OMP_NUM_THREADS ?= 1

.PHONY: demo test venv clean

venv: $(STAMP)

# torch first, pinned: a loose range would pull gigabytes of CUDA wheels.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# profile -> plan -> launch on the small built-in default, on this machine's CPU.
demo: $(STAMP)
	@mkdir -p $(OUT)
	$(BIN)/stratagem profile model --model gpt:tiny --micro-batch 1,2 --seq 64 --tp 1,2 --out $(OUT)/gpt-tiny.json
	$(BIN)/stratagem profile cluster --nproc-per-node 2 --quick --out $(OUT)/local-cpu.json
	@if $(BIN)/stratagem plan --help >/dev/null 2>&1; then \
	  $(BIN)/stratagem plan --model gpt:tiny --model-profile $(OUT)/gpt-tiny.json --cluster $(OUT)/local-cpu.json \
	    --gpus 2 --global-batch 8 --seq 64 --out $(OUT)/plan.json; fi
	@if $(BIN)/stratagem launch --help >/dev/null 2>&1 && [ -f $(OUT)/plan.json ]; then \
	  $(BIN)/stratagem launch $(OUT)/plan.json --steps 5 --metrics $(OUT)/metrics.jsonl; fi
	@if $(BIN)/stratagem show --help >/dev/null 2>&1 && [ -f $(OUT)/plan.json ]; then \
	  $(BIN)/stratagem show $(OUT)/plan.json $$( [ -f $(OUT)/metrics.jsonl ] && echo --metrics $(OUT)/metrics.jsonl ); fi

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out
