# Set-up and checks. Every target but gpu-check creates .venv and installs requirements.txt when they are missing or
# stale.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup lint test test-fast demo bench gpu-check

# pip byte-compiles the ~11,000 installed modules on one core (~30 s here); compileall does it on every
# core, and leaves out what nothing here imports: the installed packages' own tests (~2,000 modules) and
# pip/setuptools (24 s -> 15 s). Like pip, it skips the few files written for newer Pythons (hence `|| true`).
# requirements-faces.txt (the face detector for scripts/prepare_faces.py) installs without its dependencies: its
# metadata pins old torch, numpy and Pillow, and what it really imports is in requirements.txt.
$(VENV)/.installed: requirements.txt requirements-faces.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -r requirements.txt
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-faces.txt
	$(PY) -m compileall -q -j 0 -x '/tests?/|/site-packages/(pip|setuptools)/' $(VENV)/lib >/dev/null 2>&1 || true
	touch $@

# Only the set-up: .venv with everything the tools, the trainer and the tests need.
setup: $(VENV)/.installed

# ruff over the whole tree (pyproject.toml: pycodestyle, pyflakes, import order, bugbear, pyupgrade; 120 columns).
lint: $(VENV)/.installed
	$(PY) -m ruff check .

# Runs the whole suite on the CPU (gloo), on TEST_WORKERS pytest-xdist workers (a file's tests in one worker:
# tests/conftest.py). The timeouts are set for a 2-core machine; TEST_WORKERS=0 runs in this process.
# pytest's exit code 5 (nothing collected) is a failure too: a suite that runs no test proves nothing.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The inner loop: the suite without the tests that train or start a process (markers `slow` and `process`, which
# tests/conftest.py keeps true), in under three minutes. `make test` before a push runs everything.
test-fast: $(VENV)/.installed
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not process"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The whole product on this CPU in minutes: synthetic identities in the real formats, torchrun on 2 gloo
# ranks, offline verification of the trained vs the untrained backbone (work_dirs/demo/results.json).
demo: $(VENV)/.installed
	$(PY) scripts/demo.py

# Every benchmark on the CPU (about 5 minutes on a 2-core machine, longer under load); tables on stdout,
# JSON under work_dirs/bench/.
BENCH_OUT := work_dirs/bench
bench: $(VENV)/.installed
	$(PY) bench/head.py --num-classes 1000000 --world-size 2 --batch-size 128 --embedding-size 512 --threads 1 --sample-rate 0.1 --compile --repeats 9 --json $(BENCH_OUT)/head_r0.1.json
	$(PY) bench/head.py --num-classes 1000000 --world-size 2 --batch-size 128 --embedding-size 512 --threads 1 --sample-rate 1.0 --compile --repeats 5 --json $(BENCH_OUT)/head_r1.json
	$(PY) bench/head.py --num-classes 1000000 --world-size 2 --batch-size 128 --embedding-size 512 --threads 1 --sample-rate 0.1 --optimizer adamw --repeats 9 --json $(BENCH_OUT)/head_r0.1_adamw.json
	$(PY) bench/head.py --num-classes 1000000 --world-size 2 --batch-size 128 --embedding-size 512 --threads 1 --sample-rate 0.1 --update all --repeats 3 --json $(BENCH_OUT)/head_r0.1_all.json
	$(PY) bench/backbone.py --network r50 --batch-size 8 --repeats 3 --device cpu --json $(BENCH_OUT)/backbone_r50.json
	$(PY) bench/loader.py --workers 1 --json $(BENCH_OUT)/loader.json
	$(PY) bench/bin_memory.py --images 12000 --json $(BENCH_OUT)/bin_memory.json
	$(PY) bench/plan.py --num-classes 29000000 --gpus 8 --sample-rate 0.1 --embedding-size 512 --batch-size 128 --json $(BENCH_OUT)/plan.json
	$(PY) bench/prepare_faces.py --device cpu --json $(BENCH_OUT)/prepare_faces.json

# The CUDA path on a GPU machine, with that machine's own python3 and torch (no .venv, nothing downloaded):
# pytest -m cuda, backbone and head benchmarks, fp16/bf16 training runs; report in work_dirs/gpu_check/, whose last
# line (and the exit status) says verified (0), failed (1) or not verified (3). Missing pure-Python packages
# (easydict) and nvidia-dali install from wheel files: make gpu-check WHEELS=/path/to/wheels; BUDGET=420 gives the
# checks 7 minutes instead of 6
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(if $(BUDGET),--budget-s $(BUDGET))
