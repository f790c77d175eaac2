"""Where a run's record goes: run.json, the console, W&B, each one class behind one interface, so a new
backend is one more class (rank 0 holds them; docs/run_record.md).

The run calls `start` once the record holds what the run set up (before step 1), `log` once per log
window with that window's steps[] entry, and `close` once it ends, with its exit code. Each window also
reaches Trainer's own callbacks first (FinetuneTrainer.log): the progress bar prints its line there, and
transformers' WandbCallback (report_to: wandb) logs it into the W&B run this module starts.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Protocol

from finetune.telemetry.record import RecordView, RunRecord

log = logging.getLogger("finetune")


class Sink(Protocol):
    def start(self, record: RecordView) -> None: ...

    def log(self, entry: dict) -> None: ...

    def close(self, record: RecordView, exit_code: int) -> None: ...


class Sinks:
    """Every backend of a run, called in the order given."""

    def __init__(self, *sinks: Sink):
        self.sinks = sinks

    def start(self, record: RecordView) -> None:
        for sink in self.sinks:
            sink.start(record)

    def log(self, entry: dict) -> None:
        for sink in self.sinks:
            sink.log(entry)

    def close(self, record: RecordView, exit_code: int) -> None:
        for sink in self.sinks:
            sink.close(record, exit_code)


class RunJson:
    """run.json: written at the start, after each log window (steps[] and summary.steps) and at the end.
    A disk that refuses it mid-run (full, quota) is said once and training goes on, the record kept in
    memory and written again at the next window; at the end the failure is said on stderr."""

    def __init__(self, record: RunRecord):
        self.record = record
        self.failing: str | None = None  # why the last write failed, until one succeeds

    def start(self, record: RecordView) -> None:
        self.record.write()

    def log(self, entry: dict) -> None:
        self.record.add_step(entry)
        self.record.update("summary", steps=entry["step"])
        self._write()

    def close(self, record: RecordView, exit_code: int) -> None:
        if not self._write():
            print(
                f"error: {self.record.path} could not be updated with how the run ended "
                f"(status {record.status}): {self.failing}",
                file=sys.stderr,
                flush=True,
            )

    def _write(self) -> bool:
        from finetune import storage

        try:
            self.record.write()
        except OSError as e:
            failure = storage.error(e, self.record.path, f"writing {self.record.path}")
            if failure is None:
                raise
            if self.failing is None:
                log.warning("%s; training goes on, the record is written again at the next log step", failure)
            self.failing = str(failure)
            return False
        self.failing = None
        return True


def for_run(cfg, record: RunRecord, run_dir: Path) -> Sinks:
    """A run's backends (rank 0): run.json, the console, and W&B when logging.report_to names it."""
    from finetune.telemetry import wandb_logging
    from finetune.telemetry.summary import Console

    backends = [RunJson(record), Console(run_dir, run_dir / "model" if cfg.run.save_model else None, cfg.method.name)]
    if wandb_logging.enabled(cfg.logging.report_to):
        backends.append(wandb_logging.WandB(cfg.logging.wandb_project, run_dir))
    return Sinks(*backends)
