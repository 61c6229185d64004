# `make test` needs only python3 and the package registry; `make gpu-test`, `make demo` and
# `make bench` run with whatever python3 already has (the GPU machine installs nothing).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# Prefer the virtualenv `make test` made; fall back to the system python3 (the GPU machine).
RUNPY  := $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))

.PHONY: test gpu-test sanitize demo bench bench-torch ptx clean

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

# The GPU suite under memcheck, but for the PyTorch tests (hours of torch's own kernels under
# memcheck; memra's kernels they use are covered by the kernel tests). Every launch is slow
# there: fewer random cases (MEMRA_CASES) cover the same branches. Only the test process is
# checked: the subprocess tests include one that faults on purpose. Failed API calls are not counted: every one becomes a
# Python exception, and the tests that provoke them on purpose (bad PTX, a missing kernel)
# assert on it.
sanitize:
	MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-200} PYTHONPATH=. \
		compute-sanitizer --tool memcheck --target-processes application-only --report-api-errors no \
			--error-exitcode 1 \
		$(RUNPY) -m pytest -q -m "gpu and not torch"

demo:
	PYTHONPATH=. $(RUNPY) -m memra_cuda

bench:
	PYTHONPATH=. $(RUNPY) -m memra_cuda.bench $(BENCH_ARGS)

# Needs torch and transformers (the GPU machine has both): Hugging Face, graphed greedy and
# round-stream on the Llama of examples/torch_llama.py.
bench-torch:
	PYTHONPATH=. $(RUNPY) -m memra_cuda.bench --only torch $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
