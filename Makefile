# `make test` needs only python3 and the package registry; `make gpu-test`, `make demo` and
# `make bench` run with whatever python3 already has (the GPU machine installs nothing).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# Prefer the in-tree virtualenv (`make ptx` makes it); fall back to the system python3 (the GPU
# machine).
RUNPY  := $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))

.PHONY: test gpu-test sanitize racecheck demo bench bench-torch ptx clean

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

# The CI check tests what a user installs, not the tree: an editable install or the tree on
# sys.path hid a wheel that lacked memra_cuda.driver. So: build the wheel, install it with the
# test extra into a fresh virtualenv outside the tree, and run pytest from outside the tree on
# tests/ (config from pyproject.toml), so that `import memra_cuda` is the installed package.
# test_ptx.py still rebuilds ptx/ from the tree with the extra's NVRTC. Every run gets its own
# directory (runs may overlap), removed at the end unless KEEP_TEST_DIR=1. MEMRA_TEST_INSTALLED
# makes tests/test_packaging.py fail, not skip, on a package imported from the tree. No
# bytecode or pytest cache: the run writes nothing into the tree.
test:
	@set -eu; \
	dir=$$(mktemp -d "$${TMPDIR:-/tmp}/memra-cuda-test.XXXXXX"); \
	[ -n "$(KEEP_TEST_DIR)" ] || trap 'rm -rf "$$dir"' EXIT; \
	echo "make test: the wheel, its virtualenv and the pytest run are in $$dir"; \
	$(PYTHON) -m venv "$$dir/venv"; \
	py="$$dir/venv/bin/python"; \
	"$$py" -m pip install -q --upgrade pip; \
	"$$py" -m pip wheel -q --no-deps -w "$$dir/dist" .; \
	"$$py" -m pip install -q "$$(echo "$$dir"/dist/memra_cuda-*.whl)[test]"; \
	cd "$$dir"; \
	"$$py" -c "import memra_cuda, memra_cuda.models.toy, memra_cuda.driver"; \
	MEMRA_TEST_INSTALLED=1 PYTHONDONTWRITEBYTECODE=1 "$$py" -m pytest -p no:cacheprovider \
		-c "$(CURDIR)/pyproject.toml" --rootdir "$(CURDIR)" "$(CURDIR)/tests"

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
# assert on it. The largest batch end to end (`large`) is left out: its kernels are checked at
# that size by the kernel tests.
sanitize:
	MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-200} PYTHONPATH=. \
		compute-sanitizer --tool memcheck --target-processes application-only --report-api-errors no \
			--error-exitcode 1 \
		$(RUNPY) -m pytest -q -m "gpu and not torch and not large"

# Shared-memory races (racecheck) in every kernel launched alone, and in the token stream's
# protocol inside a WHILE loop (kernel 4' on a branch, the decider, a host following the mapped
# stream). The full device loop is left out: racecheck crashes the host process inside
# cuEventSynchronize whenever kernel 4 (spec_ring_commit) runs in a conditional node's body,
# with no hazard reported (docs/round-stream.md, "Checking device mode").
racecheck:
	MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-50} PYTHONPATH=. \
		compute-sanitizer --tool racecheck --target-processes application-only --report-api-errors no \
			--error-exitcode 1 \
		$(RUNPY) -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_sample_gpu.py tests/test_draft_sample_gpu.py tests/test_state_gpu.py \
			tests/test_device_loop_gpu.py -k "not device_loop_gpu or ring_protocol or publish"

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
