#!/usr/bin/env bash
# Prerequisites of the multi-host tests (tests/test_multihost.py): iproute2's
# `ip`, and network namespaces with veth pairs and a bridge (root, or
# CAP_SYS_ADMIN + CAP_NET_ADMIN).
#
#   bash tests/multihost_setup.sh    install iproute2 when missing, then probe
#
# Idempotent.  Under CI=true it exits non-zero, saying why, when namespaces
# cannot be made (the tests would fail there anyway); elsewhere it only warns,
# and the tests skip with the same reason.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "multihost setup: $*" >&2; }

if ! command -v ip >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        say "apt-get install iproute2"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
    else
        say "iproute2 (\`ip\`) is missing and cannot be installed here (needs root and apt-get)"
    fi
fi

# The one probe the tests use, so this says exactly what they will see.
if reason=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -c 'from zkv.testing.runner.netns import unavailable; print(unavailable() or "")'); [[ -z "$reason" ]]; then
    say "network namespaces, veth and bridges work: the multi-host tests will run"
elif [[ "${CI:-}" == "true" ]]; then
    say "ERROR: CI must run the multi-host tests, but: $reason"
    exit 1
else
    say "the multi-host tests will skip: $reason"
fi
