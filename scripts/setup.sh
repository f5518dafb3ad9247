#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and cpcompile (editable) with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[test]"
# Optional test dependencies (tests/test_positions_parity.py runs their models): torchtitan's and litgpt's model
# code without their training stacks (--no-deps), then only what their model modules import. litgpt pins an older
# huggingface-hub than transformers needs; its model code does not use it, so pip's conflict warning is expected.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt --no-deps torchtitan litgpt
# rotary-embedding-torch and IBM fms (tests/test_library_patterns.py): model code that needs only torch,
# transformers and einops.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt --no-deps \
  rotary-embedding-torch ibm-fms
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt \
  spmd_types einops tyro lightning psutil "jsonargparse[signatures]"
