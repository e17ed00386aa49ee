# Source on the H200 machine from the repository root: installs the carried wheels that the
# machine lacks into /tmp/site: .whl (grpc health/reflection, FastAPI stack + opentelemetry-api,
# gguf) and, when carried, .whl_fi (FlashInfer + apache-tvm-ffi).
set -e
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(ls .whl_fi/*.whl 2>/dev/null)
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
export DFLASH_HOME=/root/dflash-home
export FLASHINFER_WORKSPACE_BASE=/root/fi-cache
mkdir -p "$DFLASH_HOME/downloads" "$FLASHINFER_WORKSPACE_BASE"
set +e
