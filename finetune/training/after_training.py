"""What runs after the last optimizer step (measurements, the export, the eval loss, exact match, the
record) runs as steps of `WeightsKept`: each step ends at a boundary where every rank agrees on its
outcome (finetune/training/signals.py `agree`), so a failure on one rank is known to every rank before
any of them enters another collective, and all take the same path (docs/faults.md "Hangs and every
stop signal"):

    with WeightsKept(trainer, record, model_dir, tokenizer, limits) as kept:
        measured = kept.step("the measurements", trainer.final_measurements)
        kept.export()   # run.save_model: a step too
        ...

* a failure on any rank: every rank raises (its own error, or FailedElsewhere naming the rank and its
  error); leaving the block, every rank saves the trained weights, agreed the same way, and the error
  says where: the export, when it completed before the error; else the export is made then (also
  with run.save_model false: the run failed, and its weights are what is left of it); when that
  fails too, a complete checkpoint of the final step (Trainer's own save, another code path, and the
  completion marker), or the final step's checkpoint when the run wrote it already.
* a stop signal on any rank: every rank writes the checkpoint of the final step and raises
  signals.Stopped (the run ends preempted, exit 75).

Each step has a limit the watchdog enforces (finetune/launch/peers.py): training.finish_timeout
without progress, or training.ddp_timeout for the steps that write the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import UserError
from finetune.launch import peers
from finetune.training import signals

log = logging.getLogger("finetune")


class TrainedWeightsSaved(RuntimeError):
    """A failure after training, raised once the trained weights are safe; the message says where."""


@dataclass(frozen=True)
class Limits:
    """Seconds the watchdog gives a step after training: without progress, and to write the model."""

    finish_s: float
    save_s: float


class WeightsKept:
    def __init__(self, trainer, record, model_dir: Path, tokenizer, limits: Limits):
        self.trainer = trainer
        self.record = record  # rank 0's RunRecord: summary.checkpoint names a checkpoint saved here
        self.model_dir, self.tokenizer = Path(model_dir), tokenizer
        self.limits = limits
        self.attempted = False  # the export was started
        self.exported: Path | None = None  # ... and completed

    def step(self, what: str, fn, *, saves: bool = False):
        """fn() on this rank, then the boundary: a failure on any rank raises on every rank; a stop
        signal on any rank writes the final step's checkpoint and raises signals.Stopped on every rank."""
        result, flags = self._agreed(what, fn, saves)
        if any(flags):
            self.trainer.resilience.stop_after_training(flags)
            raise signals.Stopped(self.trainer.resilience.preempted, f"after {what}")
        return result

    def _agreed(self, what: str, fn, saves: bool):
        """(fn()'s result, every rank's signal flag); a failure on any rank raises on every rank."""
        error = result = None
        limit = self.limits.save_s if saves else self.limits.finish_s
        with peers.watch.during(what, limit):
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - agreed first, then raised on every rank
                error = e
            return result, signals.agree(self.trainer.accelerator, what, error)

    def export(self, then=None) -> None:
        """The final export (an adapter for LoRA/QLoRA, full weights otherwise) and the tokenizer, as a
        step every rank agrees on: complete from then on. `then()` runs after it on this rank (a drill)."""

        def write():
            self._write_export()
            if then:
                then()

        self.step("the export", write, saves=True)
        self.exported = self.model_dir

    def _write_export(self) -> None:
        from finetune.modeling import export

        self.attempted = True
        export.save_final_model(self.trainer, self.model_dir)
        if self.trainer.accelerator.is_main_process:
            self.tokenizer.save_pretrained(str(self.model_dir))

    def __enter__(self) -> WeightsKept:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception) or isinstance(error, signals.Stopped):
            return False  # success, or a stop: the checkpoint of the final step is written (docs/faults.md)
        where = self._save()
        if isinstance(error, UserError):
            raise UserError(f"{error}\n{where}") from None
        if hasattr(error, "exit_code") and hasattr(error, "skipped"):  # a stopped run (training/resilience.py)
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
            except Exception:  # noqa: BLE001 - on every rank (agreed); reported with the first error
                log.exception("the export after the error failed; saving a checkpoint instead")
        return self._checkpoint()

    def _checkpoint(self) -> str:
        trainer = self.trainer
        step = trainer.state.global_step
        try:
            with peers.watch.during("the checkpoint of the final step", self.limits.save_s):
                ckpt = trainer.resilience.final_checkpoint()
        except Exception as e:  # noqa: BLE001 - the first error is the one to report; this one is added to it
            log.exception("the trained weights could not be saved")
            last = trainer.resilience.last_complete
            return (
                f"the trained weights could not be saved ({type(e).__name__}: {e}); the last complete "
                f"checkpoint is {last if last else 'none written in this run'}"
            )
        if self.record is not None:
            self.record.update("summary", checkpoint=str(ckpt))
        return (
            f"the training itself completed: the export failed, and the trained weights are saved in the complete "
            f"checkpoint {ckpt} (step {step}; its model files load with from_pretrained, --resume continues from it)"
        )


def record_end(
    run, trainer, model, measured: dict, trained, results: dict, eval_loss, started: float, collapsed
) -> None:
    """The last step after training: the summary, the figures and the evaluation, into the record
    (rank 0; `run` is the phases' Run, finetune/training/run.py)."""
    from finetune.training import evaluation, fault_injection

    fault_injection.fail("record", rank=run.state.process_index, step=trainer.state.global_step)
    record = run.record
    if record is None:
        return
    record.update(
        "summary",
        eval_loss=eval_loss,
        steps=trainer.state.global_step,
        train_s=round(trained.train_s, 2),
        wall_s=round(time.perf_counter() - started, 2),
        status="failed" if collapsed else "completed",
        nonfinite_skipped=trainer.skipped_steps,
    )
    record_figures(record, measured, model, run.cfg, world=run.launch.world_size, train_loss=trained.train_loss)
    if results:
        record.set("eval", evaluation.section(results, run.heldout_path))


def record_figures(rec, measured: dict, model, cfg, *, world: int, train_loss: float | None) -> None:
    """Summary totals, memory, throughput and the prediction's error of a run whose training
    completed, whole-run for a resumed run (finetune/telemetry/formulas.py). A figure that cannot be
    computed is null with the reason in the record; the run stays completed (its training did)."""
    from finetune.planning import prediction
    from finetune.telemetry import formulas, meter, model_flops

    view = rec.view
    warmup = cfg.training.throughput_warmup_steps
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
        rec.update("summary", **summary)
        flops, reason = model_flops.from_model(model, cfg.method.name)
        figures = meter.run_figures(
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
        log.exception("run figures could not be computed; they are null in run.json, with the error")
        rec.update("summary", train_loss=train_loss, total_trained_tokens=None)
        rec.set("memory", None)
        rec.set(
            "throughput",
            {
                **formulas.throughput([], excluded=0),
                "flops_convention": None,
                "flops_per_token": None,
                "peak_device": None,
                "scope": meter.SCOPE,
                "mfu_note": f"figures not computed: {type(e).__name__}: {e}",
            },
        )
        return
    rec.set("memory", figures["memory"])
    rec.set("throughput", figures["throughput"])
    rec.update("batch", **figures["batch"])
    prediction.record_error(rec, host_lifetime_gib=measured["host_lifetime_peak_gib"])
