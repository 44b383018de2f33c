PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-all format clean

$(BIN)/automap-rl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev,external]"
	touch $@

# MCTS partitions an 8-layer GPT for a 2x4 H100 mesh, compares the plan with data parallel,
# Megatron and FSDP, then lowers it on 8 virtual CPU devices and checks its numerics on a
# smaller real-array copy of the model (the full one is too slow to run on 2 CPU cores).
demo: $(BIN)/automap-rl
	$(BIN)/automap-rl inspect gpt --rows 12
	mkdir -p runs
	time -p $(BIN)/automap-rl partition gpt:layers=8,d_model=1024 --mesh data=2,model=4 --hardware h100 \
	  --agent mcts --budget 2000 --seed 0 --plot runs/demo_plan.png --json runs/demo_plan.json \
	  --check-numerics --check-workload gpt:layers=2,d_model=128,heads=4,seq=32,vocab=256,batch=8

# `make test` leaves out tests marked slow (the same properties on more models);
# `make test-all` runs everything.
test: $(BIN)/automap-rl
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 -m "not slow" tests

test-all: $(BIN)/automap-rl
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15 tests

# Formats the tree and applies the linter's safe fixes (`make test` checks both).
format: $(BIN)/automap-rl
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) *.egg-info .cache
