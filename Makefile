# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and pinned, then the dev extras are installed under a constraint on that pin,
# so pip never resolves `torch>=2.3` (or lightning's and accelerate's torch) to a CUDA build.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo docs bench clean

# One line per step, so a first run is not a silent wait (torch alone is a large download); pip stays quiet.
$(STAMP): pyproject.toml Makefile
	@echo "==> creating the virtual environment in $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH) first, pinned (a large download: a few minutes on a fresh machine)"
	@$(BIN)/pip install --quiet $(TORCH)
	@echo '$(firstword $(TORCH))' > $(VENV)/constraints.txt
	@echo "==> installing streamshard and its dev extras (pip install -c $(VENV)/constraints.txt -e '.[dev]')"
	@$(BIN)/pip install --quiet -c $(VENV)/constraints.txt -e '.[dev]'
	@touch $(STAMP)
	@echo "==> environment ready: $(VENV)"

test: $(STAMP)
	$(BIN)/python -m pytest -q

demo: $(STAMP)
	@echo "==> running examples/demo.py"
	@$(BIN)/python examples/demo.py

# The docs/ pages as a site in site/ (mkdocs-material); --strict: a broken link, anchor or a page missing
# from mkdocs.yml's nav fails the build (tests/test_docs.py runs the same build).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/plan_scale.py

clean:
	rm -rf $(VENV) build site *.egg-info
