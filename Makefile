# `make demo`: set up and train a tiny model with CP=2 on 2 CPU processes, next to a single-process run.
# `make lint`: ruff check and ruff format --check.
# `make test`: set up, lint and run the fast tier (every claim once, at CP=2; the tests not marked `slow`).
# `make test-all`: set up, lint and run every test, both tiers (what CI runs: .ci/run).
.PHONY: setup demo lint test test-all
# Python may cache compiled bytecode (.venv and __pycache__/ are git-ignored): with PYTHONDONTWRITEBYTECODE set, as
# on some machines, every test process and rank would compile torch's and transformers' sources again on import.
unexport PYTHONDONTWRITEBYTECODE
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
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial and not slow" --durations=15
	.venv/bin/python -m pytest -q -m "serial and not slow"
test-all: lint
	.venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=15
	.venv/bin/python -m pytest -q -m serial
