#!/usr/bin/env bash
# On a GPU machine with no package index: install the parts gathered in $KIT (wheels, split wheels, converted
# models, redis-server, the dev photos) into $SITE, then run the model layer (bench.gpu) and the service
# layouts (bench.gpu_service). The CUDA and cuDNN libraries are those of
# the machine's own Python packages (nvidia-*), put on LD_LIBRARY_PATH.
#
#   KIT=/tmp/k SITE=/tmp/site OUT=/tmp/out bench/gpu_service.sh [bench.gpu_service arguments]
#
# $KIT holds: onnxruntime-gpu's and ray's cp312 wheels (whole or as .part files to concatenate), the other
# wheels the machine's python3 lacks (in whl/ too), face_recognition_models with only its 5-point predictor
# (frm/), redis-server, models/ (the converted models) and faces-dev/.
set -euo pipefail
KIT=${KIT:-/tmp/k}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
SRC=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
started=$(date +%s)

if [ ! -f "$SITE/.installed" ]; then
  cat "$KIT"/ort.part* >"$KIT/onnxruntime_gpu-1.30.0-cp312-cp312-manylinux_2_28_x86_64.whl"
  cat "$KIT"/ray.part* >"$KIT/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
  rm -f "$KIT"/ort.part* "$KIT"/ray.part*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$KIT"/*.whl "$KIT"/whl/*.whl
  cp -r "$KIT/frm/face_recognition_models" "$SITE/"
  mkdir -p "$SITE/bin" && cp "$KIT/redis-server" "$SITE/bin/" && chmod +x "$SITE/bin/redis-server"
  touch "$SITE/.installed"
fi
echo "installed in $(($(date +%s) - started)) s"

NV=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)
LIBS=$(find "$NV/nvidia" -maxdepth 3 -name lib -type d 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$SRC:$SITE"
export PATH="$SITE/bin:$PATH"
export FACESEARCH_MODELS_DIR="$KIT/models"
export FACES_DEV_DIR="$KIT/faces-dev"
export PYTHONUNBUFFERED=1
# Ray puts the driver's working directory first on its workers' path: run from the source being measured.
cd "$SRC"
python3 -c 'import onnxruntime as o; print(o.__version__, o.get_available_providers())'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

timeout 300 python3 -m bench.gpu --repeats 3 2>&1 | tee "$OUT/gpu.txt" || true
python3 -m bench.gpu_service "$@" 2>&1 | tee "$OUT/service.txt"
echo "total $(($(date +%s) - started)) s"
