# Outrider's two entry points for a fresh machine: `make demo` and `make test`.
# Each creates .venv (once) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines get the CPU build: on this machine kind `torch==2.13.0` resolves to a local
# CPU wheel. On a GPU machine set TORCH=torch (the CUDA build from PyPI).
TORCH ?= torch==2.13.0
SIZE ?= small
PORT ?= 8000

.PHONY: install demo test lint clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(VENV)/bin/outrider check-install
	touch $@

# Serves the demo family (built on first use, then cached) with speculation on an embedded
# local Ray; prints the URL when ready, Ctrl-C stops it.
demo: install
	$(VENV)/bin/outrider serve --demo $(SIZE) --port $(PORT)

# The pytest script, not `python -m pytest`: the repository root stays off sys.path, so the
# suite imports Outrider as users do, through the installed `outrider` namespace.
test: install
	$(VENV)/bin/pytest tests/cpu -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean-venv:
	rm -rf $(VENV)
