"""Test hook: which training rows each optimizer step trained on, per rank (FINETUNE_SAMPLE_TRACE=DIR):
a hash of every row of every micro-batch to DIR/rank<r>.jsonl, and rank 0's dataset row hashes to
DIR/dataset.json, so a test can recount, independently of the code under test, that a resumed run
trains the same rows per step (tests/training/test_strategies.py). Unset, it does nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

ENV = "FINETUNE_SAMPLE_TRACE"


def row_hash(ids) -> str:
    import torch

    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.long).cpu().numpy().tobytes()).hexdigest()[:16]


def record(trainer, inputs) -> None:
    """Called by the trainer for every micro-batch, before it trains on it."""
    out = os.environ.get(ENV)
    if not out:
        return
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    rank = trainer.accelerator.process_index
    if rank == 0 and not (directory / "dataset.json").exists():
        hashes = [row_hash(r) for r in trainer.train_dataset["input_ids"]]
        (directory / "dataset.json").write_text(json.dumps(hashes), encoding="utf-8")
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    rows = [row_hash(ids[i][mask[i].bool()] if mask is not None else ids[i]) for i in range(ids.shape[0])]
    with open(directory / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": trainer.state.global_step + 1, "rows": rows}) + "\n")
