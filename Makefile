# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and pinned, so pip never resolves `torch>=2.3` to a CUDA build.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/plan_scale.py

clean:
	rm -rf $(VENV) build *.egg-info
