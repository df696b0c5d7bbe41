# Two commands do all the set-up on a fresh machine:
#   make train CONFIG=configs/smoke.yaml   creates .venv if needed, then trains
#   make test                              creates .venv if needed, then runs the fast tests (not marked slow)
#   make test-all                          the whole suite, slow tests too (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
CONFIG ?= configs/smoke.yaml
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: venv train test test-all lint docs bench lock clean

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch and torchvision first, as a matched pair (the x86_64 wheels of this version lie on the local disk)
	$(PY) -m pip install -q "torch==2.14.1" "torchvision==0.29.1" || $(PY) -m pip install -q "torch>=2.4" "torchvision>=0.19"
	# everything else at the versions CI tested (constraints.txt; pyproject.toml keeps the ranges)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	@touch $@

venv: $(VENV)/.installed

train: venv
	$(PY) train.py --config $(CONFIG) $(ARGS)

test: venv
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-all: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

docs: venv
	$(PY) -m mkdocs build --strict --site-dir site

lock: venv
	$(PY) tools/lock.py

bench: venv
	$(PY) -m bench.speed overhead
	$(PY) -m bench.blocks --vs-timm

clean:
	rm -rf $(VENV) runs .pytest_cache site
