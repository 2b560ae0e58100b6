# Two commands do all the set-up: `make run` trains the default job, `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fived-installed

.PHONY: run test test-slow lint format clean figures

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fived train

test: $(STAMP)
	$(BIN)/ruff check fived tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --durations=15

test-slow: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m slow

lint: $(STAMP)
	$(BIN)/ruff check fived tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format fived tests benchmarks

# every figure of the series (out/figures: PNG + SVG + JSON each), the offline page
# (out/report/index.html, copied to docs/report.html), and the small PNG copies docs/figures.md shows (FIGURES_FLAGS=--quick
# for the tiny sizes)
figures: $(STAMP)
	$(BIN)/fived figures all --out out/figures $(FIGURES_FLAGS)
	$(BIN)/fived report --from out/figures --out out/report
	mkdir -p docs/figures && cp out/figures/*.png docs/figures/
	cp out/report/index.html docs/report.html

clean:
	rm -rf $(VENV) .pytest_cache
