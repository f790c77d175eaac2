"""Where a run's record goes: run.json, the console, W&B, each one class behind one interface, so a new backend is one
more class. When each method is called and by whom: docs/architecture.md "The sinks". The per-step stream goes to
run.json (its steps[]) and to the trackers, which take it from Trainer's log (`TRACKERS`; docs/architecture.md
"Adding a tracker"): a sink sees the record when the run starts and when it ends, never a step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

from finetune import storage
from finetune.telemetry import formulas, wandb_logging
from finetune.telemetry.record import RecordView, RunRecord
from finetune.telemetry.summary import Console

log = logging.getLogger("finetune")


# Trackers transformers does not integrate: a logging.report_to name -> the TrainerCallback that takes each log window
# (its on_log, after FinetuneTrainer added the meter's keys). The names transformers integrates (wandb, tensorboard,
# mlflow, ...) need no row: TrainingArguments.report_to gets them (finetune/training/arguments.py).
TRACKERS: tuple[tuple[str, type], ...] = ()


class Sink(Protocol):
    def start(self, record: RecordView) -> None: ...

    def close(self, record: RecordView, exit_code: int) -> None: ...


class RunJson:
    """run.json, and the only code that saves it, atomically (temporary file + rename: a reader never sees half a
    record). `commit` and `start` save or raise; from the commit on, every section handed over is saved at once, and so
    is each log window and the end. A disk that refuses it mid-run (full, quota) is said once and the run goes on, the
    record kept in memory and saved again next time; at the end the failure is said on stderr."""

    def __init__(self, record: RunRecord):
        self.record = record
        self.committed = False  # saved once: before, nothing is (a resume refused early changes nothing)
        self.failing: str | None = None  # why the last save failed, until one succeeds

    def commit(self) -> None:
        self.save()
        self.committed = True

    def start(self, record: RecordView) -> None:
        self.save()

    def changed(self) -> None:
        if self.committed:
            self._save_or_say()

    def log(self, entry: dict) -> None:
        self.record.add_step(entry)
        self.record.update("summary", steps=entry["step"])
        self._save_or_say()

    def close(self, record: RecordView, exit_code: int) -> None:
        if not self._save_or_say():
            print(
                f"error: {self.record.path} could not be updated with how the run ended "
                f"(status {record.status}): {self.failing}",
                file=sys.stderr,
                flush=True,
            )

    def save(self) -> None:
        path = self.record.path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".run.json.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.record.data, f, indent=2, default=str)
                f.write("\n")
            storage.as_umask_allows(tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def _save_or_say(self) -> bool:
        path = self.record.path
        try:
            self.save()
        except OSError as e:
            failure = storage.error(e, path, f"writing {path}")
            if failure is None:
                raise
            if self.failing is None:
                log.warning("%s; training goes on, the record is written again at the next log step", failure)
            self.failing = str(failure)
            return False
        self.failing = None
        return True


class Kept(RunJson):
    """The record kept in memory as rank 0 keeps it, never saved: every other rank's (and the benchmark's), so each
    computes the sections rank 0 computes and none of the code that hands them over asks which rank it is on."""

    def save(self) -> None:
        pass


class Sinks:
    """Every backend of a run, run.json first, called in the order given; the record they are handed."""

    def __init__(self, run_json: RunJson, *others: Sink):
        self.run_json = run_json
        self.sinks: tuple[Sink, ...] = (run_json, *others)

    @property
    def view(self) -> RecordView:
        return self.run_json.record.view

    @property
    def committed(self) -> bool:
        return self.run_json.committed

    def commit(self) -> None:
        self.run_json.commit()

    def put(self, **sections) -> None:
        """Hand over whole sections (replacing what the record held)."""
        for name, value in sections.items():
            self.run_json.record.set(name, value)
        self.run_json.changed()

    def merge(self, section: str, **fields) -> None:
        """Hand over some fields of an object section (summary, batch, ...), keeping the others."""
        self.run_json.record.update(section, **fields)
        self.run_json.changed()

    def start(self) -> None:
        for sink in self.sinks:
            sink.start(self.view)

    def log(self, entry: dict) -> None:
        """A log window's entry, into run.json's steps[] (the trackers have it from Trainer's log)."""
        self.run_json.log(entry)

    def close(self, exit_code: int) -> None:
        """The run's end, however it ended: its segment closed (when, wall time, steps: a resumed run's console
        summary and `summary.run_wall_s` cover every segment), then each backend."""
        segments = self.view.get("resumes", default=None)
        if segments:
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            closed, total = formulas.closed_segments(segments, now, self.view.get("summary", "steps") or 0)
            self.run_json.record.set("resumes", closed)
            self.run_json.record.update("summary", run_wall_s=total)
        for sink in self.sinks:
            sink.close(self.view, exit_code)


def for_run(cfg, record: RunRecord, run_dir: Path, *, main: bool) -> Sinks:
    """A run's backends: on rank 0 (`main`) run.json, the console, and W&B when logging.report_to names it; on every
    other rank the record kept in memory only (`Kept`): a sink set that writes and shows nothing."""
    if not main:
        return Sinks(Kept(record))
    backends = [Console(run_dir, run_dir / "model" if cfg.run.save_model else None, cfg.method.name)]
    if wandb_logging.enabled(cfg.logging.report_to):
        backends.append(wandb_logging.WandB(cfg.logging.wandb_project, run_dir))
    return Sinks(RunJson(record), *backends)
