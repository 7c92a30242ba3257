#!/usr/bin/env bash
# Optional: a separate venv .venv-openenv with OpenEnv (`openenv`), for `[tasks] source =
# "openenv"` (forgerl/tasks/openenv.py runs OpenEnv's own client in a worker under this venv,
# scripts/openenv_worker.py, and serves an environment's app from it) and its tests
# (tests/tasks/test_openenv.py). Kept apart from .venv because openenv 0.10 pins fastmcp<4,
# which pins mcp<2 (ForgeRL's dev venv has mcp 2 for openai-agents), and it pulls gradio and
# pandas. Idempotent: after a successful install the hash of this script and the venv's Python
# version is kept in .venv-openenv/.forgerl-setup; while it matches pip is skipped. Delete that
# file to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/retry.sh
OPENENV_PIN='openenv==0.10.0'
VENV=.venv-openenv
STAMP=$VENV/.forgerl-setup
[ -x $VENV/bin/python ] || python3 -m venv $VENV
want="$({ cat scripts/setup_openenv.sh; echo "$OPENENV_PIN $PWD"; $VENV/bin/python -V; } \
  | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
  echo "setup_openenv.sh: $VENV is up to date, pip skipped (rm $STAMP to reinstall)"
  exit 0
fi
rm -f "$STAMP"  # an interrupted install must not look complete
$VENV/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
retry $VENV/bin/python -m pip install -q "$OPENENV_PIN"
$VENV/bin/python -c "from openenv.core import GenericEnvClient, MCPEnvironment; print('setup_openenv.sh: openenv ok')"
echo "$want" >"$STAMP"
