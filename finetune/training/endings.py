"""How a run ends, on every rank: the steps after its training (`AfterTraining`, each ending at an agreed boundary) and
the endings of a run that does not complete (docs/faults.md "After training", "Hangs and every stop signal"). Each
returns what run.json should say; finetune/training/run.py hands it to the sinks.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune import held_back, storage
from finetune.checkpointing import checkpoints, resume
from finetune.errors import EXIT_PREEMPTED, UserError
from finetune.export import command as export_command
from finetune.export import live
from finetune.launch import peers, rundir
from finetune.modeling import load
from finetune.planning import prediction
from finetune.telemetry import formulas, meter, model_flops
from finetune.telemetry.record import RecordView
from finetune.training import fault_injection, planned, signals
from finetune.training.resilience import Diverged

log = logging.getLogger("finetune")


class TrainedWeightsSaved(RuntimeError):
    """A failure after training, raised once the trained weights are safe; the message says where."""


@dataclass(frozen=True)
class Limits:
    """Seconds the watchdog gives a step after training: without progress, and to write the model."""

    finish_s: float
    save_s: float


class AfterTraining:
    """The steps after the last optimizer step (docs/faults.md "After training")."""

    def __init__(
        self,
        trainer,
        model_dir: Path,
        tokenizer,
        limits: Limits,
        stops: signals.Stops,
        check: live.ExportCheck | None,
        warm=None,
    ):
        self.trainer, self.stops = trainer, stops
        self.warm = warm  # rank 0: the check's process, started with training (live.started_ahead)
        self.checkpoint: Path | None = None  # the final step's, when the export failed (run.json summary.checkpoint)
        self.model_dir, self.tokenizer = Path(model_dir), tokenizer
        self.limits = limits
        self.check = check  # how the export is checked (run.verify_export) and whether a merged one follows
        self.attempted = False  # the export was started
        self.exported: Path | None = None  # ... and completed, and checked
        self.record: dict = {}  # run.json `export` (rank 0): the check, the merged export

    def step(self, what: str, fn, *, saves: bool = False, stops: bool = True):
        """fn() on this rank, then the boundary: a failure on any rank raises on every rank; a stop
        signal on any rank writes the final step's checkpoint and raises signals.Stopped on every rank
        (`stops` False: the signal is left for the next boundary)."""
        result, flags = self._agreed(what, fn, saves, stops)
        if any(flags):
            self.trainer.resilience.stop_after_training(flags)
            raise signals.Stopped(self.trainer.resilience.preempted, f"after {what}")
        return result

    def _agreed(self, what: str, fn, saves: bool, stops: bool = True):
        """(fn()'s result, every rank's signal flag); a failure on any rank raises on every rank."""
        error = result = None
        limit = self.limits.save_s if saves else self.limits.finish_s
        with self.stops.watch.during(what, limit):
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - agreed first, then raised on every rank
                error = e
            return result, self.stops.agree(self.trainer.accelerator, what, error, with_signals=stops)

    def export(self) -> None:
        """The final export (an adapter for LoRA/QLoRA, full weights otherwise) and the tokenizer, then its check
        (finetune/export/live.py), each a step every rank agrees on: complete once checked; then the merged export
        (run.export: merged) as another. The export's drills act once it is written (docs/faults.md "Drills")."""
        rank, step = self.trainer.accelerator.process_index, self.trainer.state.global_step

        def write():
            self._write_export()
            fault_injection.fail("export", rank=rank, step=step)
            fault_injection.damage_export(self.model_dir, rank=rank, step=step)

        fault_injection.hold("slow_export", rank=rank, step=step, what="the export")
        check, batch = self.check, None
        if check is not None:  # a signal from the export's start is agreed once model/ is written (WHAT_NOW), not here
            batch = self.step("the export's probe rows", lambda: live.probe(check, self.tokenizer), stops=False)
        self.step("the export", write, saves=True)
        if check is not None:  # its own step: its forward and gathers are entered by every rank or by none
            self.step("the export's check", lambda: self._verify(batch), saves=True)
        self.exported = self.model_dir
        if check is not None and check.merged:
            self.step("the merged export", self._merged, saves=True)
        elif self.trainer.accelerator.is_main_process and (
            earlier := export_command.earlier_export(self.model_dir.parent)
        ):
            log.warning("%s", earlier)

    def _verify(self, batch) -> None:
        if self.check is None:
            return
        try:
            section = live.verify(self.trainer, self.model_dir, self.tokenizer, self.check, batch, self.warm)
        except live.ExportCheckFailed as e:
            self.record["check"] = e.section
            raise
        if section is not None:
            self.record["check"] = section

    def _merged(self) -> None:
        """Rank 0: `finetune export RUN --merge` into RUN/export (finetune/export/command.py); its figures."""
        if self.trainer.accelerator.is_main_process:
            self.record["merged"] = export_command.merge_after_training(self.model_dir.parent)

    def _write_export(self) -> None:
        self.attempted = True
        if not fault_injection.save_ungathered(self.trainer, self.model_dir, step=self.trainer.state.global_step):
            load.save_final_model(self.trainer, self.model_dir)
        if self.trainer.accelerator.is_main_process:
            self.tokenizer.save_pretrained(str(self.model_dir))

    def __enter__(self) -> AfterTraining:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or isinstance(error, signals.Stopped):
            return False  # success, or a stop: the checkpoint of the final step is written (docs/faults.md)
        where = self._save()
        failure = (
            storage.error(error, self.model_dir, f"writing the export {self.model_dir}") if self.attempted else None
        )
        if failure is not None:  # a full or read-only disk: one message, what failed and where the weights are
            held_back.TRACEBACKS.error("the export failed", exc_info=error)
            raise storage.StorageError(f"{failure}; {where}", failure.errno, failure.failed_at) from None
        if isinstance(error, UserError):
            raise UserError(f"{error}\n{where}") from None
        if isinstance(error, Diverged):  # a collapsed run that trained to the end (training/resilience.py)
            raise type(error)(f"{error}; {where}", error.skipped) from error
        raise TrainedWeightsSaved(f"{type(error).__name__}: {error}\n{where}") from error

    def _save(self) -> str:
        """On every rank (each step's failure was agreed): the export, else a checkpoint."""
        done = "the training itself completed: the trained model is exported in {}"
        if self.exported is not None:
            return done.format(self.exported)
        if not self.attempted:
            log.warning("saving the trained model before reporting the error: %s", self.model_dir)
            try:
                self._agreed("the export after the error", self._write_export, saves=True)
                return done.format(self.model_dir) + " (saved after the error)"
            except Exception as e:  # noqa: BLE001 - on every rank (agreed); reported with the first error
                held_back.TRACEBACKS.error("the export after the error failed", exc_info=e)
                return f"the export after the error failed too ({type(e).__name__}: {e}); " + self._checkpoint()
        return self._checkpoint()

    def _checkpoint(self) -> str:
        trainer = self.trainer
        step = trainer.state.global_step
        try:
            with self.stops.watch.during("the checkpoint of the final step", self.limits.save_s):
                ckpt = trainer.resilience.final_checkpoint()
        except Exception as e:  # noqa: BLE001 - the first error is the one to report; this one is added to it
            held_back.TRACEBACKS.error("the trained weights could not be saved", exc_info=e)
            last = trainer.resilience.last_complete
            return (
                f"the trained weights could not be saved in a checkpoint either ({e}); the last complete "
                f"checkpoint is {last if last else 'none written in this run'} (tracebacks: "
                f"{self.model_dir.parent / rundir.LOG_FILE})"
            )
        self.checkpoint = ckpt
        return (
            f"the training itself completed: the export failed, and the trained weights are saved in the complete "
            f"checkpoint {ckpt} (step {step}; its model files load with from_pretrained, --resume continues from it)"
        )


# --- the figures of a run whose training completed ----------------------------------------------------


def figures(view, measured: dict, model, cfg, *, world: int, train_loss: float | None) -> tuple[dict, dict]:
    """(summary fields, sections) of a run whose training completed: totals, memory, throughput and the prediction's
    error, whole-run for a resumed run (finetune/telemetry/formulas.py); `view`: the record so far. A figure that cannot
    be computed is null with the reason in the record; the run stays completed (its training did)."""
    warmup, summary = cfg.training.throughput_warmup_steps, {}
    try:
        starts = [0] + [h["step"] for h in view.get("summary", "resume_history", default=[])]
        earlier = formulas.earlier_entries(view.get("steps", default=[]), view.get("summary", "resumed_at_step"))
        summary, stretches, excluded = formulas.whole_run(
            earlier,
            starts,
            warmup=warmup,
            steps=len(measured["step_s"]),
            trained=sum(measured["trained_tokens"]),
            inputs=sum(measured["input_tokens"]),
            train_loss=train_loss,
        )
        flops, reason = model_flops.from_model(model, cfg.method.name)
        measured_figures = meter.run_figures(
            measured,
            hardware=view.get("hardware"),
            model_flops=flops,
            flops_reason=reason,
            world_size=world,
            warmup=warmup,
            earlier=stretches,
            earlier_excluded=excluded,
        )
    except Exception as e:  # noqa: BLE001 - a figure error must not turn a completed training into `failed`
        held_back.TRACEBACKS.error("run figures could not be computed", exc_info=e)
        log.warning(
            f"run figures could not be computed ({type(e).__name__}: {e}; traceback: {rundir.LOG_FILE}); they are null in run.json, with the error"
        )
        throughput = {
            **formulas.throughput([], excluded=0),
            **dict.fromkeys(("flops_convention", "flops_per_token", "peak_device")),
            "scope": meter.SCOPE,
            "mfu_note": f"figures not computed: {type(e).__name__}: {e}",
        }
        summary = {**summary, "train_loss": train_loss, "total_trained_tokens": None}
        return summary, {"memory": None, "throughput": throughput}
    after = {**view.data, "memory": measured_figures["memory"]}  # the prediction's error reads the peaks
    predicted = prediction.prediction_with_error(
        RecordView(after), host_lifetime_gib=measured["host_lifetime_peak_gib"]
    )
    sections = {"memory": measured_figures["memory"], "throughput": measured_figures["throughput"]}
    sections["batch"] = {**view.get("batch", default={}), **measured_figures["batch"]}
    if predicted is not None:
        sections["predicted_memory"] = predicted
    plan = planned.with_measured(view.get("plan", default=None), measured_figures["throughput"])
    if plan is not None:
        sections["plan"] = plan  # the predicted optimizer-step time beside the measured one
    return summary, sections


# --- a run that does not complete -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ending:
    """How a run ends: its exit code, what run.json `summary` says, and what rank 0 prints."""

    code: int
    summary: dict = field(default_factory=dict)
    said: str | None = None
    to_stderr: bool = False


def preempted(trainer, effective_batch: int, run_dir: Path) -> Ending:
    """Status `interrupted`, the resume command, and an exit code that says preempted."""
    p, ckpt = trainer.resilience.preempted, trainer.resilience.last_complete
    command = resume.resume_command(
        run_dir, effective=effective_batch, per_device=trainer.args.per_device_train_batch_size
    )
    return Ending(
        EXIT_PREEMPTED,
        dict(
            status="interrupted",
            steps=trainer.state.global_step,
            checkpoint=str(ckpt),
            error=f"preempted by {signals.cause(p)} at step {p['step']}",
            nonfinite_skipped=trainer.skipped_steps,
        ),
        f"\npreempted: {signals.cause(p)}; stopped after step {p['step']} with a complete checkpoint {ckpt}.\n"
        f"resume with:\n  {command}\nexit code {EXIT_PREEMPTED} (preempted)",
    )


def stopped_before_training(e: signals.Stopped, run_dir: Path | None, resumed: bool) -> Ending:
    """Every rank agreed to stop before training: nothing trained, so nothing to checkpoint. The record says
    `interrupted`; the same command starts the run again (its directory is reused: finetune/launch/rundir.py reusable).
    """
    again = (
        f"resume with:\n  {resume.resume_command(run_dir, effective=None, per_device=None)}"
        if resumed
        else "nothing was trained; run the same command again to start it"
    )
    return Ending(
        EXIT_PREEMPTED,
        dict(status="interrupted", error=f"stopped by {e}, before training"),
        f"\nstopped: {e}, before training.\n{again}\nexit code {EXIT_PREEMPTED} (preempted)",
    )


def diverged(e: Diverged) -> Ending:
    """A non-finite loss or gradient norm, or a collapsed model, every rank agreed on
    (finetune/training/resilience.py): recorded, said without a traceback."""
    summary = dict(status="failed", error=f"{type(e).__name__}: {e}", nonfinite_skipped=e.skipped)
    return Ending(e.exit_code, summary, f"error: {e}", to_stderr=True)


def out_of_memory(e: BaseException, cfg, rank: int, log_file: Path) -> str | None:
    """A GPU out of memory (torch.OutOfMemoryError) on this rank, said in one line with what makes a step fit: the
    levers finetune/planning/ weighs, the recipe's values, and `finetune plan`; None for any other error."""
    import torch

    if not isinstance(e, torch.OutOfMemoryError):
        return None
    t, what = cfg.training.typed, str(e).strip().splitlines()[0] if str(e).strip() else "no message"
    return (
        f"rank {rank} ran out of GPU memory ({what}). To fit a step on each GPU: a smaller "
        f"training.per_device_train_batch_size (now {t.per_device_train_batch_size}) with a larger "
        f"training.gradient_accumulation_steps (now {t.gradient_accumulation_steps}) keeps the effective batch; "
        f"training.gradient_checkpointing (now {t.gradient_checkpointing}) trades compute for activations; a smaller "
        f"data.max_length (now {cfg.data.max_length}); or a recipe that shards the model and its states (zero3, "
        f"fsdp, their _offload variants). `finetune plan --recipe {cfg.recipe}` predicts the peak per GPU before a "
        f"launch (traceback: {log_file})"
    )


def failed(e: BaseException, run) -> tuple[Ending, BaseException | None]:
    """How `run` (finetune/training/run.py Run) that failed ends, and what to raise: a StorageError for a full,
    read-only or forbidden disk (said without a traceback, finetune/storage.py), else `e`. A rank whose collective
    failed names the ranks (and nodes) that stopped answering (finetune/launch/peers.py): a rank stopped with SIGSTOP
    stops beating too. That one line says it all (the backend's error, a timeout or a closed connection, is its
    consequence), so nothing is raised and the traceback goes to the run's log file; so does a GPU out of memory
    (out_of_memory). A failure every rank agreed on (signals.Stops.failures_agreed) lost no rank."""
    run_dir = run.dir
    if isinstance(e, storage.StorageError):  # said already, with the file that failed
        failure = e
    else:
        failure = storage.error(e, run_dir, "writing the run's files") if isinstance(e, Exception) else None
    log_file = None if failure else run_dir / rundir.LOG_FILE
    rank, heartbeat = run.state.process_index, run.heartbeat
    oom = out_of_memory(e, run.cfg, rank, log_file) if log_file else None
    if oom:  # this rank's own failure, said by this rank (any rank), and told to the ranks left for run.json
        print(f"finetune: {oom}", file=sys.stderr, flush=True)
        if heartbeat:
            heartbeat.tell("oom", oom)
    elif log_file and heartbeat and not run.stops.failures_agreed and (told := heartbeat.told("oom")):
        oom = "; ".join(told.values())  # the cause: this rank's error (a closed connection, a timeout) follows from it
        print(
            f"finetune: rank {rank} stops: rank(s) {sorted(told)} ran out of GPU memory (said above; traceback: "
            f"{log_file})",
            file=sys.stderr,
            flush=True,
        )
    lost = (  # the ranks gone, if so (a failure every rank agreed on lost none)
        None
        if run.stops.failures_agreed or oom
        else peers.failure_note(failure or e, heartbeat, run.launch.machines, traceback_in=log_file)
    )
    if (lost or oom) and log_file:  # said in one line: the traceback in the run's log
        held_back.TRACEBACKS.error("%s", oom or f"this rank's error, after {lost}", exc_info=e)
    interrupted = isinstance(e, KeyboardInterrupt)
    shown = failure or e
    summary = dict(
        status="interrupted" if interrupted else "failed",
        error=None if interrupted else oom or f"{lost + '; ' if lost else ''}{type(shown).__name__}: {shown}",
    )
    if lost and lost.startswith("stuck: "):  # another rank's watchdog ended the run: what is left
        summary["checkpoint"] = newest_complete(run_dir)
    return Ending(1, summary), None if (lost or oom) and log_file else failure or e


def stuck(cause: str, run_dir: Path) -> dict:
    """run.json `summary` when the watchdog ends this rank (finetune/launch/peers.py): failed with
    `cause`, and the newest complete checkpoint, which stays (nothing is deleted)."""
    return dict(status="failed", error=cause, checkpoint=newest_complete(run_dir))


def newest_complete(run_dir) -> str | None:
    found = checkpoints.checkpoints(run_dir)
    return next((str(c) for c in reversed(found) if checkpoints.problem(c, verify=False) is None), None)
