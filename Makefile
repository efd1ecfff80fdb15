# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap .venv when it is missing.
# `make test` runs the whole suite (CI's command); `make test-fast` leaves out the tests marked `slow` (pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast test-durations install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m longstraw_jax.run --config configs/demo.toml

# two workers (2 cores; compiles are single-threaded), whole test files per worker (module-scoped compiled set-ups),
# handed out longest first (the seconds in tests/durations.json, per tier; xdist's own reorder would undo that
# order); one persistent XLA compilation cache per run, shared by both workers (tests/conftest.py)
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

test: $(STAMP)
	$(PY) -m ruff check .
	$(PYTEST)

test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PYTEST) -m "not slow"

# the whole suite, writing each test file's measured seconds per tier to tests/durations.json (the order above)
test-durations: $(STAMP)
	LONGSTRAW_TEST_DURATIONS=tests/durations.json $(PYTEST)

clean:
	rm -rf $(VENV) build *.egg-info
