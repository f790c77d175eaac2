"""The run record, `<output_dir>/run.json`: the contract between training, reports and tests.

Field names and meanings are fixed by shared/DESIGN.md ("The run record"). Rank 0 writes it
atomically (temporary file + rename) so a reader never sees half a record; `status` says
whether the run is running, completed, interrupted or failed.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from finetune.telemetry.machine import hardware, versions

SCHEMA = 1


class RunRecord:
    """Holds the record in memory; `write()` persists it (call on rank 0 only)."""

    def __init__(self, path: Path, *, run_name: str, recipe: str, config: dict):
        self.path = Path(path)
        self.data: dict = {
            "schema": SCHEMA,
            "run_name": run_name,
            "recipe": recipe,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "config": config,
            "versions": versions(),
            "hardware": hardware(),
            "strategy": None,
            "batch": None,
            "lr": None,
            "memory": None,
            "predicted_memory": None,
            "throughput": None,
            "data": None,
            "steps": [],
            "summary": {"train_loss": None, "eval_loss": None, "total_trained_tokens": None,
                        "wall_s": None, "steps": 0, "status": "running", "error": None},
            "eval": {},
        }

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, value):
        self.data[key] = value

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".run.json.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.data, f, indent=2, default=str)
                f.write("\n")
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def load(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
