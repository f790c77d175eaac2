"""Models: loading (hub id, local dir, the bundled model; full, LoRA, QLoRA), the final export, ZeRO-3 helpers."""
