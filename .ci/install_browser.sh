#!/usr/bin/env bash
# Installs Debian's chromium for the Playwright browser tests (tests/browser).
# Idempotent and quiet: does nothing when the binary is already there. We use the distribution's
# build rather than `playwright install` so CI needs no download outside the package mirrors.
set -euo pipefail

CHROMIUM=/usr/lib/chromium/chromium
if [ -x "$CHROMIUM" ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

# apt chatters on stderr even with -qq (debconf notes); keep it and show it only on failure.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq &&
       $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; } \
       >"$log" 2>&1; then
    cat "$log" >&2
    echo "install_browser.sh: installing chromium failed" >&2
    exit 1
fi

if [ ! -x "$CHROMIUM" ]; then
    echo "install_browser.sh: chromium installed but $CHROMIUM is missing" >&2
    exit 1
fi
