# Two commands set up a fresh machine: `make demo` and `make test`. Both create .venv
# and install RayMQ with its dependencies from PyPI when needed.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz fuzz-replicated clean bytecode

# make fuzz SEEDS=10000 FIRST=0: the fault simulator on many seeds (a fixed few run in
# make test); a failing seed prints the command that replays it.
SEEDS ?= 1000
FIRST ?= 0

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

# An editable install leaves RayMQ's modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set (as on our machines) Python never writes their .pyc: every Ray worker process
# (each queue, TargetList, spare) then compiled about 50 modules as it started, ~0.1 s
# of CPU each. Compiling once here takes 0.3 s when nothing changed. (A pip install
# that is not editable compiles them itself.)
bytecode: $(STAMP)
	$(VENV)/bin/python -m compileall -q raymq actors placement

demo: bytecode
	$(VENV)/bin/python examples/quickstart.py

test: bytecode
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: bytecode
	$(VENV)/bin/python -m bench.throughput

fuzz: bytecode
	$(VENV)/bin/python -m raymq.sim --seeds $(SEEDS) --first $(FIRST)

# make fuzz-replicated SEEDS=10000: the simulator's replicated mode (issue 31).
fuzz-replicated: bytecode
	$(VENV)/bin/python -m raymq.sim --seeds $(SEEDS) --first $(FIRST) --mode replicated

clean:
	rm -rf $(VENV) build *.egg-info
