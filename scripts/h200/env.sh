# Source on the H200 machine from the repository root: installs the carried wheels (.whl) that
# the machine lacks (grpc health/reflection, FastAPI stack, FlashInfer, gguf) into /tmp/site.
set -e
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
export DFLASH_HOME=/root/dflash-home
export FLASHINFER_WORKSPACE_BASE=/root/fi-cache
mkdir -p "$DFLASH_HOME/downloads" "$FLASHINFER_WORKSPACE_BASE"
set +e
