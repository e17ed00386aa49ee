#!/usr/bin/env bash
# Here, on a machine with PyPI and the prepared model (`make model`), from the repository root:
# stages what an H200 machine without a registry needs, in git-ignored folders that a device call
# carries (each call carries at most 64 MiB, the working tree included):
#   .whl/        the pinned wheels of scripts/h200/wheels.txt (and wheels_flashinfer.txt with
#                --flashinfer), Python 3.12 manylinux x86_64
#   .gpu_model/  the SmolLM2 GGUF in parts of --part-mib MiB (default 24) and SHA256SUMS: one
#                part per call (`cp .gpu_model/* /tmp/` there), then scripts/h200/assemble_smollm2.sh
#   .gpu_tok/    SmolLM2's tokenizer (the benchmarks with random weights need only this)
# Usage: bash scripts/h200/stage.sh [--flashinfer] [--part-mib N]
set -euo pipefail
flashinfer=0; part_mib=24
while [ $# -gt 0 ]; do
  case "$1" in
    --flashinfer) flashinfer=1 ;;
    --part-mib) part_mib="$2"; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
home="${DFLASH_HOME:-$HOME/.cache/dflash}"
gguf="$home/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
tok="$home/models/smollm2-135m-instruct/float32"
[ -f "$gguf" ] && [ -f "$tok/tokenizer.json" ] || { echo "run 'make model' first ($gguf)" >&2; exit 1; }
exclude="$(git rev-parse --git-common-dir)/info/exclude"
for d in .whl .gpu_model .gpu_tok; do
  grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"
done

lists=(scripts/h200/wheels.txt); [ $flashinfer = 1 ] && lists+=(scripts/h200/wheels_flashinfer.txt)
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $(grep -hv '^#' "${lists[@]}" | awk 'NF {print $1}')

rm -rf .gpu_model .gpu_tok && mkdir -p .gpu_model .gpu_tok
split -b "${part_mib}M" -d "$gguf" .gpu_model/gguf.part.
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > .gpu_model/SHA256SUMS
(cd .gpu_model && sha256sum gguf.part.* >> SHA256SUMS)
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .gpu_tok/

echo "staged: $(ls .whl | wc -l) wheels ($(du -sh .whl | cut -f1)), $(ls .gpu_model/gguf.part.* | wc -l) model parts, tokenizer"
echo "working tree that travels: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) + what a call carries"
