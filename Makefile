# The two commands of the README: `make demo` and `make test`. Everything else helps them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed $(VENV)-sky/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash examples/demo.sh

# SkyPilot's parser, for the scheduler example tests, in its own environment (see pyproject.toml).
$(VENV)-sky/.installed: tests/requirements-skypilot.txt
	$(PYTHON) -m venv $(VENV)-sky
	$(VENV)-sky/bin/python -m pip install -q -r tests/requirements-skypilot.txt
	touch $@

test: setup
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

bench: setup
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VENV)-sky out build *.egg-info
