# Two commands from a fresh clone:  make train   and   make test
# Both create .venv if there is none and install the project into it: `make train` the core (what
# the default run imports), `make test` every extra too (`make extras` alone). A torch that is
# already installed (in .venv, or in the Python that creates it) is reused, never downloaded again.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS := dev,sweeps,tl,dashboard,llc
EXTRAS_STAMP := $(VENV)/.installed-extras

.PHONY: train test test-fast extras browser lint format bench axioms figure rescore stages clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	@# torch from the system site (if any) satisfies the requirement; else take the CPU wheel
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0" || $(BIN)/pip install "torch>=2.4,<3"
	$(BIN)/pip install -e .
	@touch $(STAMP)

$(EXTRAS_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[$(EXTRAS)]"
	@touch $(EXTRAS_STAMP)

extras: $(EXTRAS_STAMP)

# the explorer's browser tests: Debian's chromium (as root; else the line says how), driven by playwright (dev extra)
browser: $(EXTRAS_STAMP)
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; }; } || \
		echo "no chromium: sudo apt-get install chromium (the explorer's browser tests skip without it)"

train: $(STAMP)
	$(BIN)/python train.py $(ARGS)

# three workers, each test file on one (its module fixtures trained once), the files with the most slow
# tests first (tests/conftest.py): on 2 cores a third worker runs while another waits on a subprocess,
# a signal or SLURM (2026-12-07, empty cache: 484-598 s in the checkout, 482-651 s from a fresh clone;
# 749-850 s in the checkout while the VM ran 1.5 times as slow that morning, 721-770 s in the checkout and
# 687-731 s from a fresh clone that afternoon, two workers 681-718 s beside them; bench/README.md)
TEST_WORKERS ?= 3
# the suite keeps Python's bytecode (__pycache__/, git-ignored) even where PYTHONDONTWRITEBYTECODE is set (the
# development VM's image sets it): else each of the suite's ~60 processes compiles the project's modules again
# (~0.3 core-seconds each) and each worker of a later suite rewrites every test file's asserts (~3.7 each)
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: lint browser
	$(PYTEST) $(ARGS)

test-fast: lint browser
	$(PYTEST) -m "not slow" $(ARGS)

lint: $(EXTRAS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(EXTRAS_STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python -m bench.throughput $(ARGS)

axioms: $(STAMP)
	$(BIN)/python -m bench.axiom_table $(ARGS)

figure: $(STAMP)
	$(BIN)/python -m reports.run_report $(RUN)

rescore: $(STAMP)
	$(BIN)/python -m analysis.rescore $(RUN) $(ARGS)

stages: $(EXTRAS_STAMP)
	$(BIN)/python -m analysis.stages $(RUN) $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
