#!/usr/bin/env bash
# A separate venv .venv-verifiers with verifiers 0.4.0 (prime-rl's environment format) for the
# verifiers task source (forgerl/tasks/verifiers.py runs scripts/verifiers_worker.py under its
# Python) and its tests (tests/tasks/test_verifiers.py). Kept apart from .venv because verifiers
# pins mcp==2.0.0 and openai<3 (ForgeRL's venv has newer ones). Also installs the test
# environments written here to verifiers' format (tests/tasks/envs/verifiers/: vf-arith,
# vf-calc), editable. Idempotent: after a successful install the hash of this script, the test
# environments' pyproject files, the checkout's path and the venv's Python version is kept in
# .venv-verifiers/.forgerl-setup; while it matches pip is skipped. Delete that file to reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/retry.sh
VERIFIERS_PIN='verifiers==0.4.0'
VENV=.venv-verifiers
STAMP=$VENV/.forgerl-setup
ENVS=tests/tasks/envs/verifiers
[ -x $VENV/bin/python ] || python3 -m venv $VENV
want="$({ cat scripts/setup_verifiers.sh $ENVS/*/pyproject.toml; echo "$VERIFIERS_PIN $PWD"
  $VENV/bin/python -V; } | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
  echo "setup_verifiers.sh: $VENV is up to date, pip skipped (rm $STAMP to reinstall)"
  exit 0
fi
rm -f "$STAMP"  # an interrupted install must not look complete
$VENV/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
retry $VENV/bin/python -m pip install -q "$VERIFIERS_PIN"
for env in $ENVS/*/; do retry $VENV/bin/python -m pip install -q --no-deps -e "$env"; done
$VENV/bin/python -c "import verifiers, vf_arith, vf_calc; print('setup_verifiers.sh: verifiers', verifiers.__version__)"
echo "$want" >"$STAMP"
