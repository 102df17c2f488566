#!/usr/bin/env bash
# Prerequisites of the distributed tier's tests (tests/test_keyed_store.py and the
# vLLM server tests that share a store): Debian's redis-server, and redis-py
# (the `store` extra of setup.cfg; the test extra pins it too).
#
#   bash tests/redis_setup.sh    install redis-server when missing (root and apt-get), then check it
#
# Idempotent.  Under CI=true a missing redis-server is an error (the tests would
# fail anyway); elsewhere the tests skip, saying so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "redis setup: $*" >&2; }

if ! command -v redis-server >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "apt-get install redis-server"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
        # Debian's package starts a system-wide server on 6379; the tests start their own on free ports.
        if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi
    else
        say "redis-server is missing and cannot be installed here (needs root and apt-get)"
    fi
fi

if command -v redis-server >/dev/null 2>&1 && python -c 'import redis' 2>/dev/null; then
    say "ok: $(redis-server --version | cut -d' ' -f1-3), redis-py $(python -c 'import redis; print(redis.__version__)')"
elif [[ "${CI:-}" == "true" ]]; then
    say "ERROR: CI must run the store tests, but redis-server or redis-py is missing"
    exit 1
else
    say "the store tests will skip: redis-server or redis-py is missing"
fi
