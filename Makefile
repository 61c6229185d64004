# `make test` needs only python3 and the package registry. The targets that run the tree
# (demo, bench, gpu-test, sanitize, racecheck) take their python from tools/pick-python: the
# in-tree .venv where it has memra_cuda's dependencies, else the system python3 where it has them
# (the GPU machine, which reaches no package index: nothing is installed there), else a .venv
# made then with `pip install -e .` (needs the package index).
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
export PYTHON VENV

# At a recipe's start: "$$py" is the python that runs the tree (`test`: with pytest and hypothesis).
PICK      = py=$$(sh tools/pick-python) || exit 1;
PICK_TEST = py=$$(sh tools/pick-python test) || exit 1;

# The CUDA 12 bindings, as wheels carried to the GPU machine (it reaches no package index): the
# lowest cuda-python that pyproject.toml accepts (12.6.2.post1, which holds cuda.bindings itself)
# and numpy 1.26 (the last before 2), for CPython 3.12 on manylinux x86_64. `make gpu-test` runs
# the highest, the GPU machine's 13.x. The last 12.x, which CUDA 12 users mostly run, is another
# download: make wheels-cuda12 WHEELS12="cuda-bindings==12.9.4 cuda-pathfinder==1.9.1 numpy==1.26.4".
WHEELS12 ?= cuda-python==12.6.2.post1 numpy==1.26.4
SITE12   ?= /tmp/site12

.PHONY: help test gpu-test gpu-test-cuda12 wheels-cuda12 sanitize racecheck demo bench bench-torch pair pair-twice soak served ptx clean

# `make` alone lists the targets (it made .venv, the first rule's file, and said nothing).
.DEFAULT_GOAL := help

help:
	@echo "make test             lint, type-check, build the wheel and run the suite against it (GPU tests skip without a GPU)"
	@echo "make demo             the toy model decoded speculatively on GPU 0, checked against its greedy output"
	@echo "make gpu-test         the GPU suite from the tree (GPU_JOBS=N: in N processes; PYTEST_ARGS: more of pytest's)"
	@echo "make gpu-test-cuda12  the GPU suite on the CUDA 12 bindings of .whl12/, which make wheels-cuda12 downloads"
	@echo "make wheels-cuda12    the wheels of the lowest CUDA 12 bindings and numpy 1.26, into .whl12/"
	@echo "make sanitize         the GPU suite under compute-sanitizer's memcheck, but the PyTorch tests"
	@echo "make racecheck        the kernels' GPU tests under compute-sanitizer's racecheck"
	@echo "make bench            benchmarks/bench.py on the GPU (BENCH_ARGS: its flags, --quick for a smoke run)"
	@echo "make ptx              rebuild ptx/*.ptx from ptx/'s CUDA sources"
	@echo "make clean            remove .venv and the caches"
	@echo "With the torch extra and a GPU (a pair trains on the CPU too, slowly):"
	@echo "make pair             train the target and draft the PyTorch benchmarks measure, or find them in .cache/pair/"
	@echo "make pair-twice       train the pair twice and check that it reproduces"
	@echo "make bench-torch      the PyTorch benchmarks: the pair, then the random-weight Llamas"
	@echo "make served           the pair serving a request stream through B slots (SERVED_ARGS: its flags)"
	@echo "make soak             5,000 requests through a server's slots, each checked (SOAK_ARGS: its flags)"

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
# bytecode, pytest or ruff cache: the run writes nothing into the tree.
# Quiet where all is well: a step's output (venv, pip) is shown only when it fails; ruff and mypy
# (the extra's, configured in pyproject.toml) check the tree first, and the suite runs whatever
# they find; any of them failing fails the target. pytest -q: no header, no file-by-file
# progress; skips come as one line per reason (tests/conftest.py). The benchmarks' host-side
# tests import `benchmarks`, a program of the checkout, not of the wheel: the run's directory
# (python's first path) holds a link to it.
test:
	@set -eu; \
	dir=$$(mktemp -d "$${TMPDIR:-/tmp}/memra-cuda-test.XXXXXX"); \
	[ -n "$(KEEP_TEST_DIR)" ] || trap 'rm -rf "$$dir"' EXIT; \
	echo "make test: the wheel, its virtualenv and the pytest run are in $$dir"; \
	quiet() { "$$@" >"$$dir/step.log" 2>&1 || { cat "$$dir/step.log"; echo "make test: failed: $$*" >&2; exit 1; }; }; \
	quiet $(PYTHON) -m venv "$$dir/venv"; \
	py="$$dir/venv/bin/python"; \
	quiet "$$py" -m pip install --upgrade pip; \
	quiet "$$py" -m pip wheel --no-deps -w "$$dir/dist" .; \
	quiet "$$py" -m pip install "$$(echo "$$dir"/dist/memra_cuda-*.whl)[test]"; \
	lint=0; "$$py" -m ruff check --no-cache --output-format concise memra_cuda tests examples benchmarks ptx/build.py \
		|| lint=$$?; \
	types=0; "$$py" -m mypy --cache-dir "$$dir/mypy" memra_cuda examples || types=$$?; \
	ln -s "$(CURDIR)/benchmarks" "$$dir/benchmarks"; \
	cd "$$dir"; \
	"$$py" -c "import memra_cuda, memra_cuda.testing.toy, memra_cuda.driver"; \
	suite=0; MEMRA_TEST_INSTALLED=1 PYTHONDONTWRITEBYTECODE=1 "$$py" -m pytest -q -p no:cacheprovider \
		-c "$(CURDIR)/pyproject.toml" --rootdir "$(CURDIR)" "$(CURDIR)/tests" || suite=$$?; \
	[ $$lint = 0 ] || echo "make test: ruff check found the violations listed above (ruff check --fix mends most)"; \
	[ $$types = 0 ] || echo "make test: mypy found the type errors listed above"; \
	[ $$lint = 0 ] && [ $$types = 0 ] && [ $$suite = 0 ]

ptx: $(VENV)/.installed
	$(VPY) ptx/build.py

# MEMRA_REQUIRE_GPU turns "no driver" from a skip into a failure: on the GPU machine a skipped
# suite must not pass for a green one. PYTEST_ARGS: more of pytest's arguments (files, -k, -x).
# The suite's time is the host's (a ten-minute command ran 70% of it on the H200's): GPU_JOBS=N runs it
# in N processes on the one GPU (pytest-xdist; 8 ran it all in three minutes there), then the tests marked
# `alone` by themselves (they read the device's free memory, time the host against a loop, or fill
# most of its memory). A part that selects nothing (pytest's 5) is no failure unless both do.
# Under GPU_JOBS each process compiles in itself (TORCHINDUCTOR_COMPILE_THREADS=1, unless set): with a
# pool of compile workers each, the eight sat up to five minutes at exit in the pools' shutdown after
# every test had passed (torch 2.11 on the H200).
GPU_JOBS ?=
RUN_GPU_SUITE = \
	[ -z "$(GPU_JOBS)" ] || export TORCHINDUCTOR_COMPILE_THREADS=$${TORCHINDUCTOR_COMPILE_THREADS:-1}; \
	suite() { echo "MEMRA_REQUIRE_GPU=1 PYTHONPATH=$$PYTHONPATH $${TORCHINDUCTOR_COMPILE_THREADS:+TORCHINDUCTOR_COMPILE_THREADS=$$TORCHINDUCTOR_COMPILE_THREADS }$$py -m pytest -m '$$1' $$ignore $(PYTEST_ARGS) $$2"; \
		"$$py" -m pytest -m "$$1" $$ignore $(PYTEST_ARGS) $$2; }; \
	if [ -z "$(GPU_JOBS)" ]; then suite "$$marks" ""; exit; fi; \
	"$$py" -c "import xdist" 2>/dev/null || { echo "GPU_JOBS=$(GPU_JOBS) needs pytest-xdist (pip install pytest-xdist)" >&2; exit 1; }; \
	a=0; suite "$$marks and not alone" "-n $(GPU_JOBS)" || a=$$?; \
	b=0; suite "$$marks and alone" "" || b=$$?; \
	[ $$a = 0 -o $$a = 5 ] && [ $$b = 0 -o $$b = 5 ] && [ $$a$$b != 55 ]

gpu-test:
	@$(PICK_TEST) export MEMRA_REQUIRE_GPU=1 PYTHONPATH=.; marks=gpu; ignore=; $(RUN_GPU_SUITE)

# The GPU suite again on the lowest CUDA 12 bindings and numpy 1.26 (what a CUDA 12 driver's user
# installs), from the wheels of .whl12/ (`make wheels-cuda12`, where the index is reachable;
# carry .whl12/ to the GPU machine), installed apart in $(SITE12) and put ahead of the system's
# packages; the system python3 (3.12 there) has the rest: pytest, hypothesis. Not the PyTorch
# tests (`make gpu-test` runs them): the machine's torch stack is built for numpy 2 (transformers
# imports scipy, which needs np.long) and cannot import with numpy 1.26 ahead of it.
# The modules that import torch or transformers as they are collected, which numpy 1.26 ahead of the
# machine's torch stack cannot: not collected at all (benchmarks/pair.py's test imports transformers'
# models, whose import fails there though `import transformers` alone, lazy, succeeds).
NOT_TORCH := --ignore=tests/pytorch --ignore=tests/comm/test_torch_tp.py --ignore=tests/bench/test_pair.py

gpu-test-cuda12:
	@set -eu; \
	ls .whl12/*.whl >/dev/null 2>&1 || { echo "gpu-test-cuda12: no wheels in .whl12/: run \`make wheels-cuda12\` where the package index is reachable, and bring .whl12/ here" >&2; exit 1; }; \
	rm -rf "$(SITE12)"; \
	$(PYTHON) -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --target "$(SITE12)" \
		.whl12/*.whl; \
	PYTHONPATH="$(SITE12):." $(PYTHON) -c 'import sys, cuda.bindings, numpy; \
		b, n = cuda.bindings.__version__, numpy.__version__; \
		print(f"gpu-test-cuda12: cuda.bindings {b} ({cuda.bindings.__path__[0]}), numpy {n} ({numpy.__path__[0]})"); \
		sys.exit(0 if b.startswith("12.") and n.startswith("1.26.") else \
			f"gpu-test-cuda12: wanted cuda.bindings 12.x and numpy 1.26, imported {b} and {n}")'; \
	export MEMRA_REQUIRE_GPU=1 PYTHONPATH="$(SITE12):."; py=$(PYTHON); marks="gpu and not torch"; ignore="$(NOT_TORCH)"; \
	$(RUN_GPU_SUITE)

# Downloads the wheels of $(WHEELS12) into .whl12/ (ignored by git, never committed), replacing
# what was there only once every one has come.
wheels-cuda12:
	@set -eu; \
	tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/memra-cuda-whl12.XXXXXX"); trap 'rm -rf "$$tmp"' EXIT; \
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d "$$tmp" $(WHEELS12); \
	rm -rf .whl12; mkdir .whl12; mv "$$tmp"/*.whl .whl12/; \
	ls -1 .whl12; du -sh .whl12

# The GPU suite under memcheck, but for the PyTorch tests (hours of torch's own kernels under
# memcheck; memra's kernels they use are covered by the kernel tests). Every launch is slow
# there: fewer random cases (MEMRA_CASES) cover the same branches. Only the test process is
# checked: the subprocess tests include one that faults on purpose. Failed API calls are not counted: every one becomes a
# Python exception, and the tests that provoke them on purpose (bad PTX, a missing kernel)
# assert on it. The largest batch end to end (`large`) is left out: its kernels are checked at
# that size by the kernel tests. PYTEST_ARGS (files, -k) narrows the run, for sanitize and racecheck:
# the whole suite takes over ten minutes under memcheck, so on a machine that runs a command ten
# minutes at most, run it in two parts, PYTEST_ARGS="--ignore=tests/testing --ignore-glob='tests/*/test_tree_*_gpu.py'"
# (all but the toy's and the trees' files) and PYTEST_ARGS="tests/testing tests/kernels/test_tree_kernels_gpu.py
# tests/rounds/test_tree_round_gpu.py".
sanitize:
	$(PICK_TEST) MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-200} PYTHONPATH=. \
		compute-sanitizer --tool memcheck --target-processes application-only --report-api-errors no \
			--error-exitcode 1 \
		"$$py" -m pytest -q -m "gpu and not torch and not large" $(PYTEST_ARGS)

# Shared-memory races (racecheck) in every kernel launched alone, and in the token stream's
# protocol inside a WHILE loop (kernel 4' on a branch, the decider, a host following the mapped
# stream). The full device loop is left out: racecheck crashes the host process inside
# cuEventSynchronize whenever kernel 4 (spec_ring_commit) runs in a conditional node's body,
# with no hazard reported (docs/device-mode.md, "Checking device mode").
racecheck:
	$(PICK_TEST) MEMRA_REQUIRE_GPU=1 MEMRA_CASES=$${MEMRA_CASES:-50} PYTHONPATH=. \
		compute-sanitizer --tool racecheck --target-processes application-only --report-api-errors no \
			--error-exitcode 1 \
		"$$py" -m pytest -q -m gpu tests/kernels/test_kernels_gpu.py tests/kernels/test_sample_gpu.py tests/kernels/test_draft_sample_gpu.py tests/kernels/test_state_gpu.py \
			tests/kernels/test_tree_kernels_gpu.py tests/rounds/test_device_loop_gpu.py -k "not device_loop_gpu or ring_protocol or publish" \
			$(PYTEST_ARGS)

demo:
	@$(PICK) PYTHONPATH=. "$$py" -m memra_cuda

bench:
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.bench $(BENCH_ARGS)

# Needs torch, transformers and tokenizers (the GPU machine has them): first the headline on the
# trained pair (benchmarks/headline.py; `make pair` runs before it, and trains the pair where its
# cache is empty), then Hugging Face, graphed greedy and round-stream on the random-weight Llamas
# of memra_cuda.torch.testing through memra_cuda.torch, and its trees section chains against trees;
# BENCH_ARGS="--json PATH" also writes the headline's figures as they come (PATH's .headline.json)
# and the pictures, PATH's .headline.png and .png (with
# matplotlib, the plot extra); BENCH_ARGS="--sections headline" runs some sections alone (the whole
# run takes longer than a GPU machine's ten-minute command: the pair minutes of its own, the headline
# about six). The headline measures the pair of pair.py's default settings
# (python -m benchmarks.headline --pair DIR measures another).
bench-torch: pair
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.bench --only torch $(BENCH_ARGS)

# A trained target and draft (benchmarks/pair.py; needs torch, transformers and tokenizers, which
# tools/pick-python does not install): trained on the GPU from this machine's own Python sources,
# kept in .cache/pair/ and reused (a second run lists the corpus and finds it, seconds).
pair:
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.pair $(PAIR_ARGS)

# Whether the pair reproduces (benchmarks/pair_twice.py, issue 47 item 5): pair.py twice into two
# empty caches (PAIR_CACHES="DIR DIR"; default two temporary folders), its PAIR_ARGS each time, then
# both reports side by side; fails unless the losses are within 0.02 nats/token and the draft's
# top-1 agreement within a point.
pair-twice:
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.pair_twice $(if $(PAIR_CACHES),--caches $(PAIR_CACHES)) -- $(PAIR_ARGS)

# A server's soak (benchmarks/soak.py; torch and transformers, a GPU): 5,000 requests through 64
# slots of a chain decoder, refusals and cancels mixed in; fails unless nothing is lost, device
# memory stays flat and every checked request is its own greedy decoding alone. SOAK_ARGS: its flags.
soak:
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.soak $(SOAK_ARGS)

# The served headline (benchmarks/served.py): the trained pair serving a request stream through B
# slots, the plain decoding and chains alike, at B = 1 to 128. SERVED_ARGS="--json PATH" also
# writes the figures and the picture.
served: pair
	$(PICK) PYTHONPATH=. "$$py" -m benchmarks.served $(SERVED_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
