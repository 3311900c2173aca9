#!/usr/bin/env bash
# Installs specserve from this checkout (editable), with optional extras: `setup.sh test,bench`.
#
# torch comes first and on its own: when no torch is installed, a bare `torch` requirement makes
# pip fetch the default (CUDA) build of several GB. A torch wheel in pip's local wheelhouse
# (`find-links`, e.g. a CPU build on a CPU machine) is preferred; without one, pip's default
# index decides. An already installed torch is kept whatever its version.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="${1:-}"
if ! python -c "import torch" >/dev/null 2>&1; then
    if pip install --no-index --no-deps torch >/dev/null 2>&1; then
        # The wheelhouse gave torch alone; its dependencies come from the index, torch pinned to it.
        pip install "torch==$(pip show torch | sed -n 's/^Version: //p')"
    else
        pip install torch
    fi
fi
pip install -e ".${extras:+[$extras]}"
