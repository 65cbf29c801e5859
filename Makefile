# Two commands: `make test` and `make demo`. Both bootstrap .venv idempotently.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install redis bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The Redis index is tested against a real redis-server; install it when absent.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "redis-server missing: installing it with apt-get"; \
	  (apt-get update -qq || sudo apt-get update -qq) >/dev/null && \
	  (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server || \
	   sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }
	@redis-server --version

test: install redis
	$(BIN)/python -m pytest -q -ra

demo: install
	$(BIN)/kvrouter demo

bench: install
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) *.egg-info
