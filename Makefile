PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/automap-rl: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --pre -e ".[dev]"
	touch $@

demo: $(BIN)/automap-rl
	$(BIN)/automap-rl inspect gpt --rows 12
	$(BIN)/automap-rl partition gpt:layers=8,d_model=1024 --mesh data=2,model=4 --hardware h100

test: $(BIN)/automap-rl
	$(BIN)/python -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) *.egg-info
