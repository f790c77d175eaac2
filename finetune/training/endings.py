"""How a run that does not complete ends, on every rank: preempted (a signal during or after
training: a complete checkpoint, exit 75), stopped before training (nothing to save, exit 75),
diverged (exit 3), failed (the record says why, the error goes on) or stuck (the watchdog's stop). Rank 0 records it and says
it once (docs/faults.md). `run` is the phases' Run (finetune/training/run.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from finetune.errors import EXIT_PREEMPTED

if TYPE_CHECKING:
    from finetune.training.arguments import RunArguments
    from finetune.training.resilience import ResilientTrainer


def preempted(run, trainer: ResilientTrainer, arguments: RunArguments) -> int:
    """Status `interrupted`, the resume command, and an exit code that says preempted."""
    from finetune.checkpointing import resume
    from finetune.training.signals import cause

    p, ckpt = trainer.resilience.preempted, trainer.resilience.last_complete
    trainer.record_tail()  # steps[] up to the checkpoint's step: the resumed run totals from it
    if run.record:
        run.record.update(
            "summary",
            status="interrupted",
            steps=trainer.state.global_step,
            checkpoint=str(ckpt),
            error=f"preempted by {cause(p)} at step {p['step']}",
            nonfinite_skipped=trainer.skipped_steps,
        )
        run.sinks.close(run.record.view, EXIT_PREEMPTED)
        command = resume.resume_command(
            run.dir, effective=arguments.batch["effective"], per_device=trainer.args.per_device_train_batch_size
        )
        print(
            f"\npreempted: {cause(p)}; stopped after step {p['step']} with a complete checkpoint {ckpt}.\n"
            f"resume with:\n  {command}\nexit code {EXIT_PREEMPTED} (preempted)",
            flush=True,
        )
    return EXIT_PREEMPTED


def stopped_before_training(run, e, teardown) -> int:
    """Every rank agreed to stop before training (signals.Stopped): nothing trained, so nothing to
    checkpoint. The record says `interrupted`; the same command starts the run again (its directory
    is reused: finetune/launch/rundir.py reusable)."""
    from finetune.checkpointing import resume

    teardown.ended_cleanly()
    if run is not None and run.record and run.committed:
        run.record.update("summary", status="interrupted", error=f"stopped by {e}, before training")
        run.sinks.close(run.record.view, EXIT_PREEMPTED)
    if run is None or run.state.is_main_process:
        again = (
            f"resume with:\n  {resume.resume_command(run.dir, effective=None, per_device=None)}"
            if run is not None and run.resume
            else "nothing was trained; run the same command again to start it"
        )
        print(f"\nstopped: {e}, before training.\n{again}\nexit code {EXIT_PREEMPTED} (preempted)", flush=True)
    return EXIT_PREEMPTED


def diverged(run, e) -> int:
    """A non-finite loss or gradient norm, or a collapsed model, every rank agreed on (training/resilience.py):
    recorded, said without a traceback."""
    if run.record and run.committed:
        run.record.update("summary", status="failed", error=f"{type(e).__name__}: {e}", nonfinite_skipped=e.skipped)
        run.sinks.close(run.record.view, e.exit_code)
        print(f"error: {e}", file=sys.stderr, flush=True)
    run.teardown.ended_cleanly()
    return e.exit_code


def failed(run, e: BaseException) -> BaseException:
    """Record how the run ended (rank 0) and return what to raise: a StorageError for a full,
    read-only or forbidden disk (said without a traceback, finetune/storage.py), else `e`. A rank
    whose collective failed names the ranks (and nodes) that stopped answering (finetune/launch/peers.py):
    a rank stopped with SIGSTOP stops beating too."""
    from finetune import storage
    from finetune.launch import peers
    from finetune.training import signals

    failure = storage.error(e, run.dir, "writing the run's files") if isinstance(e, Exception) else None
    # the ranks gone, if so (a failure every rank agreed on lost none)
    lost = None if signals.failures_agreed else peers.failure_note(failure or e, run.heartbeat, run.launch.machines)
    if run.record and run.committed:
        interrupted = isinstance(e, KeyboardInterrupt)
        shown = failure or e
        run.record.update(
            "summary",
            status="interrupted" if interrupted else "failed",
            error=None if interrupted else f"{lost + '; ' if lost else ''}{type(shown).__name__}: {shown}",
        )
        if lost and lost.startswith("stuck: "):  # another rank's watchdog ended the run: what is left
            run.record.update("summary", checkpoint=_newest_complete(run.dir))
        run.sinks.close(run.record.view, 1)
    return failure or e


def stuck(run, cause: str) -> None:
    """The watchdog ends this rank (finetune/launch/peers.py; its thread, the main thread held in a
    collective): rank 0 records the run failed with `cause` and the newest complete checkpoint, which
    stays (nothing is deleted). No sink is closed and no collective entered: either could hang too."""
    if not (run.record and run.committed):
        return
    run.record.update("summary", status="failed", error=cause, checkpoint=_newest_complete(run.dir))
    run.record.write()


def _newest_complete(run_dir) -> str | None:
    from finetune.checkpointing import checkpoints

    found = checkpoints.checkpoints(run_dir)
    return next((str(c) for c in reversed(found) if checkpoints.problem(c, verify=False) is None), None)
