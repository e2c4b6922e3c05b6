# Two commands set up a fresh machine: `make demo` and `make test`. Both create .venv
# and install RayMQ with its dependencies from PyPI when needed.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean

# make fuzz SEEDS=10000 FIRST=0: the fault simulator on many seeds (a fixed few run in
# make test); a failing seed prints the command that replays it.
SEEDS ?= 1000
FIRST ?= 0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python examples/quickstart.py

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/python -m bench.throughput

fuzz: $(STAMP)
	$(VENV)/bin/python -m raymq.sim --seeds $(SEEDS) --first $(FIRST)

clean:
	rm -rf $(VENV) build *.egg-info
