#!/usr/bin/env bash
# vLLM 0.34's own offload classes, for the contract tests of zkv's connector
# against the vLLM that GPU users install (tests/vllm034, docs/engine-vllm.md
# "Versions").  0.34 is a CUDA build (it wants torch 2.14) and runs no engine
# here, but its offload interfaces are pure Python: the wheel goes in without
# its dependencies, beside the CPU torch and the pure-Python packages those
# modules import (about 90 s).  No engine, no CUDA kernel is ever loaded.
#
#   bash tests/vllm034_setup.sh                          make or update .venv-vllm034
#   .venv-vllm034/bin/python -m pytest tests/vllm034 -n 0   run the contract tests
#
# Idempotent.  Needs Python >= 3.11; under CI=true a missing one is an error,
# elsewhere the contract tests are simply not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "vllm 0.34 setup: $*" >&2; }
PY=${ZKV_VLLM_PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "vLLM needs Python >= 3.11; $PY is $("$PY" -V 2>&1)"
    [[ "${CI:-}" == "true" ]] && exit 1
    exit 0
fi
[[ -x .venv-vllm034/bin/python ]] || "$PY" -m venv .venv-vllm034
VPY=.venv-vllm034/bin/python
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps vllm==0.34.0
# What vllm.v1.kv_offload and the offloading connector import, at the versions 0.34 pins.
"${PIP[@]}" packaging psutil pyzmq urllib3 regex numpy pydantic 'transformers>=5.16.1,<5.23.0' aiohttp requests \
    pillow pybase64 cachetools cbor2 msgspec cloudpickle uvloop py-cpuinfo prometheus_client \
    'llguidance>=1.7.0,<1.8.0' xgrammar==0.2.8 einops
"${PIP[@]}" -e . pytest pytest-timeout pytest-xdist==3.8.0
"$VPY" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector, zkv.engines.vllm.connector'
say "ok: $("$VPY" -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))') in .venv-vllm034"
