#!/usr/bin/env bash
# Wheels for the GPU check (bench/gpu_check.sh), run HERE before the device call: the device image has its own
# transformers (5.17 when last read) and no xgrammar or pydantic, and it reaches no registry. Tests that compare
# against transformers' internals (Gated DeltaNet, GPT-OSS experts) and the grammar mask need our pins, so they travel
# as wheels in .whl/ (ignored by git; name it in the device call's `carry`), and gpu_check.sh installs them first.
# Usage: bash bench/gpu_wheels.sh   (then: run with carry [".whl"] and command `bash bench/gpu_check.sh`)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
pin() { grep -oE "\"$1==[^\";]+" pyproject.toml | head -1 | tr -d '"'; }  # our exact pin, e.g. transformers==5.24.0
# xgrammar's and pydantic's own needs, at the versions the project's venv resolved
have() { $PY -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
X=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$X")"; grep -qx "/.whl/" "$X" 2>/dev/null || echo /.whl/ >>"$X"
rm -rf .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 -d .whl \
  "$(pin transformers)" "$(pin tokenizers)" "$(pin xgrammar)" "$(pin pydantic)" "$(have pydantic_core)" \
  "$(have annotated_types)" "$(have typing_inspection)" "$(have apache-tvm-ffi)"
du -sh .whl && ls .whl
