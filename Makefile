# The two commands for a fresh machine:  make demo   and   make test
VENV ?= .venv
BIN := $(VENV)/bin
STATE_DIR ?= .qosmq

.PHONY: setup demo test lint typecheck down clean

setup:
	@bash scripts/setup.sh

## Bring up a local 3-node RabbitMQ cluster and run a short confirm-mode benchmark.
demo: setup
	$(BIN)/qosmq demo --state-dir $(STATE_DIR)
	@echo "cluster left running: '$(BIN)/qosmq cluster status' / 'make down'"

## Set up and run every test (unit, real-broker, cluster, chaos, spark).
test: setup
	$(BIN)/python -m pytest -p no:cacheprovider

lint: setup
	$(BIN)/ruff check middleware qosmq_bench tests spark
	$(BIN)/ruff format --check middleware qosmq_bench tests spark

typecheck: setup
	$(BIN)/mypy

down:
	$(BIN)/qosmq cluster down --state-dir $(STATE_DIR)

clean: down
	rm -rf $(STATE_DIR) $(VENV) *.egg-info
