# miniTE. `make demo` sets up a virtual environment (CPU PyTorch) and runs the main job (GRPO on the
# built-in tiny model, NVFP4, on CPU); `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-interpreter bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel first, so that no resolver pulls a CUDA build of torch
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/minite train --run-dir runs/train

test: setup
	$(PY) -m pytest -q

test-interpreter: setup  ## only the Triton kernels, on the CPU under TRITON_INTERPRET=1
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpreter

bench:  ## on a GPU machine: the kernel table of docs/benchmarks.md
	$(PYTHON) bench/gemm.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
