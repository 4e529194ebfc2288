# miniTE. `make demo` sets up a virtual environment (CPU PyTorch) and runs the main job: the RL run
# (GRPO, NVFP4, built-in tiny model, CPU) through the rollout and learner services (`minite up`);
# `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: setup demo up-local train test test-reliability test-interpreter proto compose-config bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel first, so that no resolver pulls a CUDA build of torch
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

demo: up-local

up-local: setup  ## rollout + learner (+ Prometheus when installed) as local processes, RL job, then stop
	$(VENV)/bin/minite up --run-dir runs/up

train: setup  ## the same RL job in one process, no services
	$(VENV)/bin/minite train --run-dir runs/train

proto: setup  ## regenerate the committed gRPC stubs in minite/v1 from proto/minite/v1/*.proto
	cd proto && ../$(PY) -m grpc_tools.protoc -I . --python_out=.. --pyi_out=.. --grpc_python_out=.. minite/v1/*.proto

compose-config:  ## validate docker-compose.yml offline (Debian's docker-compose v1 client; a placeholder token)
	MINITE_AUTH_TOKEN=validate-only docker-compose -f docker-compose.yml config -q

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

test-reliability: setup  ## the reliability and security scenarios alone (also part of `make test`), figures printed
	$(PY) -m pytest -q -s tests/serve/test_reliability_serving.py tests/serve/test_reliability_learner.py \
		tests/serve/test_openapi_fuzz.py tests/serve/test_grpc_refusals.py tests/serve/test_rest_refusals.py \
		tests/serve/test_operator_safety.py tests/serve/test_input_bounds.py tests/serve/test_weight_push_bounds.py \
		tests/serve/test_http_timeouts.py tests/serve/test_model_limits.py

test-interpreter: setup  ## only the Triton kernels, on the CPU under TRITON_INTERPRET=1
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m interpreter

bench:  ## on a GPU machine: the kernel table of docs/benchmarks.md
	$(PYTHON) bench/gemm.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
