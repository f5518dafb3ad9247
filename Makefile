# `make demo`: set up and train a tiny model with CP=2 on 2 CPU processes, next to a single-process run.
# `make test`: set up and run the test suite (what CI runs).
.PHONY: setup demo test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/python examples/demo_cp.py
test: setup
	.venv/bin/python -m pytest -q
