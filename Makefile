# dpclip: `make demo` sets everything up and runs the main job; `make test` runs the test suite.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -c constraints.txt
JEMALLOC := /usr/lib/x86_64-linux-gnu/libjemalloc.so.2
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench data clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) -q torch==2.13.0
	$(PIP) -q -e ".[test]"
	touch $(STAMP)

# System packages: Fashion-MNIST (Debian) and jemalloc, when we are root and they are missing.
data:
	@if [ ! -d /usr/share/datasets/fashion-mnist ] || [ ! -e $(JEMALLOC) ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist libjemalloc2 >/dev/null; \
	  else \
	    echo "not root: install the Debian packages dataset-fashion-mnist and libjemalloc2, or"; \
	    echo "put the Fashion-MNIST IDX files in a directory and set DPCLIP_DATA to it"; \
	  fi; \
	fi

setup: $(STAMP) data

# The main job: a quick comparison of clipping strategies on Fashion-MNIST.
demo: setup
	$(BIN)/python -m dpclip.demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

bench: setup
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
