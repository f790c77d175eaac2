"""The figures of a run whose training completed, into its record: summary totals (whole-run for a
resumed run), memory, throughput and MFU, and the memory prediction's error."""

from __future__ import annotations

import logging

from finetune.telemetry.record import RunRecord

log = logging.getLogger("finetune")


def record_figures(rec: RunRecord, measured: dict, model, cfg, *, world: int, train_loss: float | None) -> None:
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
