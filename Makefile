# `make test` needs only python3 and the package registry; `make gpu-test`, `make demo` and
# `make bench` run with whatever python3 already has (the GPU machine installs nothing).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# Prefer the virtualenv `make test` made; fall back to the system python3 (the GPU machine).
RUNPY  := $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))

.PHONY: test gpu-test sanitize demo bench ptx clean

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

test: $(VENV)/.installed
	$(VPY) -m pytest

ptx: $(VENV)/.installed
	$(VPY) ptx/build.py

# MEMRA_REQUIRE_GPU turns "no driver" from a skip into a failure: on the GPU machine a skipped
# suite must not pass for a green one.
gpu-test:
	MEMRA_REQUIRE_GPU=1 PYTHONPATH=. $(RUNPY) -m pytest -m gpu

# Under memcheck every launch is slow: fewer random cases (MEMRA_CASES) cover the same branches.
sanitize:
	MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-200} PYTHONPATH=. \
		compute-sanitizer --tool memcheck --error-exitcode 1 \
		$(RUNPY) -m pytest -q -m gpu tests/test_round_stream_gpu.py tests/test_spec_gpu.py

demo:
	PYTHONPATH=. $(RUNPY) -m memra_cuda

bench:
	PYTHONPATH=. $(RUNPY) -m memra_cuda.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
