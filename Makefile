# The two commands of the README. Both create .venv and install the project on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

# Reinstall when the dependencies, the build hook or the gRPC contract change: the
# install step is also what generates the protobuf stubs.
$(STAMP): pyproject.toml setup.py $(wildcard protos/*.proto)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/slicewise demo

# Two workers, one test file at a time each (a file's tests share its cluster); the 2
# cores are 92-95% busy through a run (/proc/stat, 2026-12-03), so the suite's time is
# its CPU. xdist starts the files with the most tests first; starting the slowest first
# (--no-loadscope-reorder) took as long in clean runs on the same afternoon.
test: install
	$(PY) -m pytest -n 2 --dist loadfile

# ruff on everything; mypy on the controller, the workers, the client and the shared layer.
LINTED := controller worker programs benchmarks tests slicewise
lint: install
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy controller worker slicewise


clean:
	rm -rf $(VENV) build *.egg-info protos/*_pb2*.py protos/*_pb2*.pyi
