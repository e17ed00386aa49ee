# On the H200: join the SmolLM2 GGUF carried in parts over consecutive calls while the machine
# stayed warm (each call copied its part to /tmp: `cp .gpu_*/gguf.part.* /tmp/`), check its
# sha256, and prepare the HF directories (no download needed).
set -e
cat /tmp/gguf.part.0* > "$DFLASH_HOME/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $DFLASH_HOME/downloads/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
python3 -m dflash.cli prepare-model smollm2-135m-instruct --dtype bfloat16 --dtype float32 --quiet
set +e
