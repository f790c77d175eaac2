"""What runs after the last optimizer step (measurements, the export, the eval loss, exact match, the
record) runs inside `WeightsKept`: if any of it fails, the trained weights are saved first and the
error says where they are (docs/faults.md "After training").

    with WeightsKept(trainer, record, model_dir, tokenizer) as kept:
        ...
        kept.export()          # run.save_model: the export, known to be complete from here on
        ...

Saved where: the export, when it completed before the error; else the export is made then (also with
run.save_model false: the run failed, and its weights are what is left of it); when the export
itself failed, a complete checkpoint of the final step (Trainer's own save, another code path, and
the completion marker), or the final step's checkpoint when the run wrote it already.
Saving is a collective like every checkpoint: an error on every rank (the data, the evaluation)
saves on every rank; a rank that failed alone leaves the others to their collective timeout.
"""

from __future__ import annotations

import logging
from pathlib import Path

from finetune.checkpointing import checkpoints
from finetune.errors import UserError

log = logging.getLogger("finetune")


class TrainedWeightsSaved(RuntimeError):
    """A failure after training, raised once the trained weights are safe; the message says where."""


class WeightsKept:
    def __init__(self, trainer, record, model_dir: Path, tokenizer):
        self.trainer = trainer
        self.record = record  # rank 0's RunRecord: summary.checkpoint names a checkpoint saved here
        self.model_dir, self.tokenizer = Path(model_dir), tokenizer
        self.attempted = False  # the export was started
        self.exported: Path | None = None  # ... and completed

    def export(self) -> Path:
        """The final export (an adapter for LoRA/QLoRA, full weights otherwise) and the tokenizer."""
        from finetune.modeling.load import save_final_model

        self.attempted = True
        save_final_model(self.trainer, self.model_dir)
        if self.trainer.accelerator.is_main_process:
            self.tokenizer.save_pretrained(str(self.model_dir))
        self.exported = self.model_dir
        return self.model_dir

    def __enter__(self) -> WeightsKept:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or not isinstance(error, Exception):
            return False  # success, or a signal: they act as usual after training (docs/faults.md)
        where = self._save()
        if isinstance(error, UserError):
            raise UserError(f"{error}\n{where}") from None
        if hasattr(error, "exit_code") and hasattr(error, "skipped"):  # a stopped run (training/collapse.py)
            raise type(error)(f"{error}; {where}", error.skipped) from error
        raise TrainedWeightsSaved(f"{type(error).__name__}: {error}\n{where}") from error

    def _save(self) -> str:
        done = "the training itself completed: the trained model is exported in {}"
        if self.exported is not None:
            return done.format(self.exported)
        if not self.attempted:
            log.warning("saving the trained model before reporting the error: %s", self.model_dir)
            try:
                return done.format(self.export()) + " (saved after the error)"
            except Exception:  # noqa: BLE001 - reported with the first error; a checkpoint is tried next
                log.exception("the export after the error failed; saving a checkpoint instead")
        return self._checkpoint()

    def _checkpoint(self) -> str:
        trainer = self.trainer
        step = trainer.state.global_step
        ckpt = Path(trainer.args.output_dir) / f"checkpoint-{step}"
        try:
            if checkpoints.problem(ckpt, verify=False) is not None:  # not written at the last step already
                log.warning("saving the trained weights before reporting the error: %s", ckpt)
                trainer._save_checkpoint(trainer.model_wrapped, trial=None)
                trainer.resilience.on_save(trainer.args, trainer.state, trainer.control)  # barrier, marker
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


def record_figures(rec, measured: dict, model, cfg, *, world: int, train_loss: float | None) -> None:
    """Summary totals, memory, throughput and the prediction's error of a run whose training
    completed, whole-run for a resumed run (finetune/telemetry/totals.py). A figure that cannot be
    computed is null with the reason in the record; the run stays completed (its training did)."""
    from finetune.planning import prediction
    from finetune.telemetry import formulas, meter, model_flops, totals

    view = rec.view
    warmup = cfg.training.throughput_warmup_steps
    try:
        starts = [0] + [h["step"] for h in view.get("summary", "resume_history", default=[])]
        earlier = totals.earlier_entries(view.get("steps", default=[]), view.get("summary", "resumed_at_step"))
        summary, stretches, excluded = totals.whole_run(
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
