#!/usr/bin/env bash
# Measure the service on a GPU machine with no package index, from the GPU offline kit
# (docs/offline-kit.md; docs/performance.md, "Measuring a GPU box", has the exact calls):
#
#   KIT=/tmp/k SITE=/tmp/site OUT=/tmp/out bash bench/gpu_service.sh [bench.gpu_service arguments]
#   KIT=/tmp/k SITE=/tmp/site bash bench/gpu_service.sh --install-only
#
# $KIT holds the kit as `make kit KIT_VARIANT=gpu KIT_PYTHON=<the machine's python3>` wrote it (install.sh,
# MANIFEST.json, facesearch-kit.tar.NNN), the dev photos in $KIT/faces-dev (or FACES_DEV_DIR), and any
# Debian packages the service needs on that machine as .deb files (unpacked, never installed). The kit is
# installed once into $SITE (its own virtual environment, redis-server, the converted models; or, where
# python3 cannot make a virtual environment, the wheels in $SITE/lib for python3); a later run finds it there. The CUDA and cuDNN libraries are those of the machine's own Python packages (nvidia-*),
# put on LD_LIBRARY_PATH. The code measured is this source tree's ($PYTHONPATH), the kit supplies the rest.
set -euo pipefail
KIT=${KIT:-/tmp/k}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
started=$(date +%s)

# The kit's install.sh makes a virtual environment; a Python without ensurepip (Debian's, without its venv
# package) cannot, and then the same wheels go into $SITE/lib with pip --target for the machine's python3.
install_kit() {
  if [ -z "${FORCE_TARGET_INSTALL:-}" ] && PYTHON=${PYTHON:-python3} sh "$KIT/install.sh" "$SITE" >"$OUT/install.txt" 2>&1; then
    return
  fi
  echo "installing the kit's wheels with pip --target (install.sh: see $OUT/install.txt)"
  rm -rf "$SITE" && mkdir -p "$SITE"
  sha=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["archive_sha256"])' "$KIT/MANIFEST.json")
  cat "$KIT"/facesearch-kit.tar.[0-9][0-9][0-9] >"$SITE/kit.tar"
  echo "$sha  $SITE/kit.tar" | sha256sum -c --quiet -
  tar -xf "$SITE/kit.tar" -C "$SITE" && rm "$SITE/kit.tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE/lib" \
    "$SITE"/wheels/*.whl >>"$OUT/install.txt" 2>&1
}

if [ ! -x "$SITE/venv/bin/python" ] && [ ! -d "$SITE/lib" ]; then
  install_kit
  for deb in "$KIT"/*.deb; do
    if [ -e "$deb" ]; then dpkg -x "$deb" "$SITE/debs"; fi
  done
  echo "kit installed in $(($(date +%s) - started)) s"
fi
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)
LIBS=$(find "$NV/nvidia" -maxdepth 3 -name lib -type d 2>/dev/null | tr '\n' ':' || true)
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
if [ -x "$SITE/venv/bin/python" ]; then
  PY="$SITE/venv/bin/python"
  export PYTHONPATH="$SRC"
else
  PY=python3
  export PYTHONPATH="$SRC:$SITE/lib"
fi
export PATH="$SITE/venv/bin:$SITE/bin:$SITE/debs/usr/sbin:$SITE/debs/usr/bin:$PATH"
export FACESEARCH_MODELS_DIR="$SITE/models"
export FACES_DEV_DIR="${FACES_DEV_DIR:-$KIT/faces-dev}"
export PYTHONUNBUFFERED=1
# Ray puts the driver's working directory first on its workers' path: run from the source being measured.
cd "$SRC"
"$PY" -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if [ -n "${GPU_MODEL_LAYER:-}" ]; then  # the model layer alone (bench.gpu), when there is time for it
  timeout 300 "$PY" -m bench.gpu --repeats 3 2>&1 | tee "$OUT/gpu.txt" || true
fi
"$PY" -m bench.gpu_service --json "$OUT/gpu_service.json" "$@" 2>&1 | tee "$OUT/gpu_service.txt"
echo "total $(($(date +%s) - started)) s"
