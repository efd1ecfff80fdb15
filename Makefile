# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m longstraw_jax.run

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) build *.egg-info
