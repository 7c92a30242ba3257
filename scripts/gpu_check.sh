#!/usr/bin/env bash
# The GPU checks of issues 12-14 in one device call (scripts/gpu_check.py writes
# $OUT/gpu_check.json and prints one line per check). The device image has torch, transformers
# and Python 3.12 but not ForgeRL's other dependencies; the checks import only torch,
# transformers and ForgeRL's engine and trainer. A newer transformers than the image's can be
# carried as a wheel: `bash scripts/gpu_check.sh --wheels` here downloads ours into .whl/
# (git-ignored through .git/info/exclude); then run on the device with carry [".whl"]:
#   bash scripts/gpu_check.sh
# On a CPU: `bash scripts/gpu_check.sh --cpu` runs the same checks on the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--wheels" ]]; then
  grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
  version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl "transformers==$version"
  exit 0
fi
if [[ "${1:-}" == "--cpu" ]]; then
  exec .venv/bin/python scripts/gpu_check.py --device cpu --tiny --out "${OUT:-.}"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
timeout 480 python3 scripts/gpu_check.py --device cuda --out "${OUT:-.}"
