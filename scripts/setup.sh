#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and cpcompile (editable) with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# uv installs the rest: the same pins (constraints.txt) in seconds where pip takes most of a minute.
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt uv
UV=(.venv/bin/uv pip install -q --python .venv/bin/python -c constraints.txt)
# pip's local wheel folders (the CPU torch on the project's machines), from its config and environment: uv reads
# neither.
for d in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
  UV+=(--find-links "$d")
done
# torch pinned: an unpinned torch would pull a multi-GB CUDA build.
"${UV[@]}" torch==2.13.0 -e ".[test]"
# Optional test dependencies (tests/test_positions_parity.py runs their models): torchtitan's and litgpt's model
# code without their training stacks (--no-deps), then only what their model modules import. litgpt pins an older
# huggingface-hub than transformers needs; its model code does not use it.
"${UV[@]}" --no-deps torchtitan litgpt
# rotary-embedding-torch and IBM fms (tests/test_library_patterns.py): model code that needs only torch,
# transformers and einops.
"${UV[@]}" --no-deps rotary-embedding-torch ibm-fms
"${UV[@]}" spmd_types einops tyro lightning psutil "jsonargparse[signatures]"
