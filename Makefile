# Two commands do all set-up on a fresh machine with Python 3.11+ and make:
#   make demo   runs the main job on the embedded broker and Redis
#   make test   passes the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install deps demo test test-fast lint docs bench soak clean compile uncompile apache-pulsar apache-pulsar-stop test-apache-pulsar image image-lock release screenshots pulsar-guard

$(STAMP): pyproject.toml setup.py setup.cfg requirements.lock tests/cloudevents-sdk2.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	PUSH_WORKER_COMPILE=0 $(BIN)/pip install --quiet -c requirements.lock -e '.[dev,embedded]'
	$(PYTHON) -m venv $(VENV)/cloudevents2
	$(VENV)/cloudevents2/bin/pip install --quiet -r tests/cloudevents-sdk2.txt
	touch $(STAMP)

install: $(STAMP)

# What `make test` drives besides Python, from Debian's packages (as root; .ci/run runs this):
# Prometheus (promtool, a scraping server), kubectl (kustomize), openssl (a self-signed certificate),
# iptables (partitions), chromium and chromium-driver (the console's browser tests), buildah and
# mmdebstrap (the image, built without a daemon). Java 17 and Maven (the broker guard, Apache
# Pulsar) come with the machine. Installs only when one is missing.
DEBIAN_DEPS := prometheus kubectl openssl iptables chromium chromium-driver fonts-liberation buildah mmdebstrap
DEPS_COMMANDS := prometheus kubectl openssl iptables chromium chromedriver buildah mmdebstrap

deps:
	@missing=""; for tool in $(DEPS_COMMANDS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then echo "make deps: all present"; else \
	  echo "make deps: installing (missing:$$missing)"; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(DEBIAN_DEPS) >/dev/null; fi

# The development tools (devtools/: the demo, benchmarks, soak) are not in the shipped package; the
# editable install puts them on the path: `$(DEV) <command> --help` lists their options.
DEV := $(BIN)/python -m devtools

demo: $(STAMP)
	$(DEV) demo

# The package as the image builds it (setup.py's hook: worker/core compiled with mypyc), installed
# into .build/compiled, out of the checkout; built again when a source changed. ON_COMPILED runs a
# command on it: that copy first on the path, and no working directory on it (PYTHONSAFEPATH: a
# `python -m worker.cli` started from the checkout would import the sources instead).
COMPILE     := $(BIN)/python -m devtools.compile
COMPILED    := $(CURDIR)/.build/compiled
ON_COMPILED := PYTHONPATH=$(COMPILED) PYTHONSAFEPATH=1

compile: $(STAMP)
	$(COMPILE)

uncompile: $(STAMP)
	$(COMPILE) --clean

# The reference tables of docs/configuration.md, made again from the fields' declarations
# (tests/test_docs.py fails when the page and the declarations differ).
docs: $(STAMP)
	$(BIN)/python -m devtools.config_reference --write

# The console's screenshots in docs/images (its browser test, with Debian's chromium and chromium-driver).
screenshots: $(STAMP)
	PUSH_WORKER_SCREENSHOTS=docs/images $(BIN)/pytest -p no:cacheprovider -q tests/test_console.py -k "operator or newcomer or endpoint_view or config_file"

lint: $(STAMP)
	$(BIN)/ruff check worker devtools tests
	$(BIN)/mypy

# The quick loop: lint, types and every test that needs no broker and starts no worker process
# (about two minutes on a 2-core machine: they wait on Redis and local endpoints more than they
# compute, so TEST_WORKERS run at once, then any marked `alone`); `make test` runs them all.
FAST := PUSH_WORKER_TEST_FAST=1 $(BIN)/pytest -p no:cacheprovider -q
test-fast: lint
	$(FAST) -n $(TEST_WORKERS) -m "not alone" && ($(FAST) -m alone || [ $$? -eq 5 ])

# The suite runs on the compiled package (what the image runs; built unless up to date). Test
# modules are imported from the checkout after the package (--import-mode=append). Its tests wait
# on I/O (brokers, endpoints, leases): TEST_WORKERS of them run at once (pytest-xdist), then those
# marked `alone` (cgroups, iptables) one at a time.
TEST_WORKERS    ?= 3
PYTEST_COMPILED := $(ON_COMPILED) PUSH_WORKER_TEST_COMPILED=1 $(BIN)/pytest -p no:cacheprovider --import-mode=append
SUITE           := $(PYTEST_COMPILED) -n $(TEST_WORKERS) -m "not alone" && $(PYTEST_COMPILED) -m alone

test: lint
	$(COMPILE)
	$(SUITE)

# A real Apache Pulsar standalone (resolved from Maven Central by tools/apache-pulsar/pom.xml), in
# the background on 127.0.0.1:$(PULSAR_PORT) with its admin API on $(PULSAR_HTTP_PORT); fresh data each start.
PULSAR_PORT      ?= 6650
PULSAR_HTTP_PORT ?= 8080
APACHE_PULSAR    := $(BIN)/python -m devtools.apache_pulsar --dir .apache-pulsar

apache-pulsar: pulsar-guard
	$(APACHE_PULSAR) start --port $(PULSAR_PORT) --http-port $(PULSAR_HTTP_PORT)

# push-worker's broker-side guard (deploy/pulsar-guard: a Pulsar entry filter, Java 17 and Maven), as
# deploy/pulsar-guard/target/nar/pulsar-guard.nar; every Apache Pulsar the project starts loads it.
pulsar-guard: $(STAMP)
	$(BIN)/python -c 'from devtools.apache_pulsar import ensure_guard; print(ensure_guard())'

apache-pulsar-stop: $(STAMP)
	$(APACHE_PULSAR) stop

# The suite again, on the Apache Pulsar `make apache-pulsar` started (tests that kill or restart
# their broker start an Apache Pulsar of their own).
test-apache-pulsar: $(STAMP)
	$(COMPILE)
	export PUSH_WORKER_TEST_PULSAR_URL=pulsar://127.0.0.1:$(PULSAR_PORT) \
	PUSH_WORKER_TEST_PULSAR_ADMIN_URL=http://127.0.0.1:$(PULSAR_HTTP_PORT) && $(SUITE)

bench: $(STAMP)
	$(COMPILE)
	$(ON_COMPILED) $(DEV) bench $(BENCH_ARGS)

soak: $(STAMP)
	$(DEV) soak --seconds $(or $(SOAK_SECONDS),60)

# The image's locks with hashes: deploy/requirements.txt (the runtime dependencies at the versions of
# requirements.lock, plus pip and setuptools: deploy/build-tools.in) and deploy/compile-requirements.txt
# (mypyc for the build stage: deploy/compile-tools.in). Run after changing any of them.
image-lock: $(STAMP)
	$(BIN)/pip install --quiet pip-tools
	grep -v '^#' requirements.lock > $(VENV)/lock-constraints.txt
	PIP_FIND_LINKS= $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	  --no-emit-find-links -c $(VENV)/lock-constraints.txt -o deploy/requirements.txt pyproject.toml deploy/build-tools.in
	PIP_FIND_LINKS= $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	  --no-emit-find-links -c $(VENV)/lock-constraints.txt -o deploy/compile-requirements.txt deploy/compile-tools.in

# The image from deploy/Dockerfile with buildah (devtools/image.py), tagged with the version;
# IMAGE_BASE: auto (python:3.11-slim pinned where a registry answers, else Debian's Python), pinned, debian.
VERSION    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_BASE ?= auto

image: $(STAMP)
	$(BIN)/python -m devtools.image --tag localhost/push-worker:$(VERSION) --base $(IMAGE_BASE) build

# A release from the checked-out commit: checks that CHANGELOG.md has the version's section, then
# the compiled wheel, the locks and the image (an OCI archive) into dist/ (docs/upgrading.md#releasing).
release: $(STAMP)
	$(BIN)/python -m devtools.releases build --base $(IMAGE_BASE)

clean:
	rm -rf $(VENV) .build dist worker/*.so .push-worker .pytest_cache .apache-pulsar tools/apache-pulsar/lib tools/apache-pulsar/target deploy/pulsar-guard/target
