"""`dflash prepare-model`: fetch real models, convert them into Hugging Face-format directories."""
