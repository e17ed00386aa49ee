# Source on the H200 machine from the repository root: installs the wheels staged by
# scripts/h200/stage.sh (.whl: exactly the pinned lists, checked here) into /tmp/site, and sets
# the environment (DFLASH_HOME, the FlashInfer JIT cache).
set -e
if [ ! -f /tmp/site/.installed ]; then
  for name in $(grep -hv '^#' scripts/h200/wheels.txt | awk 'NF {print $1}' | cut -d= -f1 | tr - _); do
    ls .whl/ | grep -iq "^${name}-" || { echo "env.sh: .whl lacks $name (run scripts/h200/stage.sh here, carry .whl)" >&2; return 1; }
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
export PATH=/tmp/site/bin:$PATH     # py-spy (wheels_profile.txt), when staged
export PYTHONUNBUFFERED=1
export DFLASH_HOME=/root/dflash-home
export FLASHINFER_WORKSPACE_BASE=/root/fi-cache
mkdir -p "$DFLASH_HOME/downloads" "$FLASHINFER_WORKSPACE_BASE"
set +e
