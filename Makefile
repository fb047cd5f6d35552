# Two commands do all set-up on a fresh machine with Python 3.11+ and make:
#   make demo   runs the main job on the embedded broker and Redis
#   make test   passes the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint bench soak clean

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c requirements.lock -e '.[dev,embedded]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/push-worker demo

test: $(STAMP)
	$(BIN)/ruff check worker tests
	$(BIN)/mypy
	$(BIN)/pytest -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/push-worker bench

soak: $(STAMP)
	$(BIN)/push-worker soak --seconds $(or $(SOAK_SECONDS),60)

clean:
	rm -rf $(VENV) .push-worker .pytest_cache
