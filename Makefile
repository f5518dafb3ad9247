# `make demo`: set up and train a tiny model with CP=2 on 2 CPU processes, next to a single-process run.
# `make lint`: ruff check and ruff format --check.
# `make test`: set up, lint and run the test suite (what CI runs).
.PHONY: setup demo lint test
setup:
	bash scripts/setup.sh
demo: setup
	.venv/bin/python examples/demo_cp.py
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
# Two processes share the cores (whole files per process); the tests that bound how fast a peer reacts run alone
# after them.
test: lint
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=15
	.venv/bin/python -m pytest -q -m serial
