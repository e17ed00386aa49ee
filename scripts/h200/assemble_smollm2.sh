# On the H200: join the SmolLM2 GGUF parts staged by scripts/h200/stage.sh and copied to /tmp
# over consecutive calls while the machine stayed warm (`cp .gpu_model/* /tmp/` in each call),
# check every part's and the whole file's sha256, and prepare the HF directories (no download).
set -e
(cd /tmp && grep gguf.part SHA256SUMS | sha256sum -c --quiet)
cat /tmp/gguf.part.* > "$DFLASH_HOME/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
(cd "$DFLASH_HOME/downloads" && grep -v gguf.part /tmp/SHA256SUMS | sha256sum -c)
python3 -m dflash.cli prepare-model smollm2-135m-instruct --dtype bfloat16 --dtype float32 --quiet
set +e
