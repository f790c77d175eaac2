"""The console: the run's layout in one line before step 1, and the end-of-run table (what was trained,
how fast, how much memory, what it changed). Rank 0."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

from finetune import precision
from finetune.telemetry.record import RecordView

log = logging.getLogger("finetune")


class Console:
    """The console as a sink of the run's record (finetune/telemetry/sinks.py). Each log window's line
    is the progress bar's (finetune/training/trainer.py CompactProgress), a callback of Trainer's log."""

    def __init__(self, run_dir: Path, model_dir: Path | None, method: str):
        self.run_dir, self.model_dir, self.method = run_dir, model_dir, method

    def start(self, record: RecordView) -> None:
        log.info("%s", start_line(record))

    def close(self, record: RecordView, exit_code: int) -> None:
        if exit_code == 0:
            print_summary(record, self.run_dir, self.model_dir, self.method)


def start_line(record: RecordView) -> str:
    """World size, batch, learning rate, parameters, length and precision, as the run set them up."""
    b, p = record.get("batch"), record.get("parameters")
    policy = precision.get(record.get("precision", "policy"))
    fallback = record.get("speed", "attention", "fallback", default=None)
    return (
        f"{sizes(record)} | per-device batch {b['per_device']} x accumulation {b['grad_accum']} x data-parallel "
        f"size {b['data_parallel_size']} = effective batch {b['effective']} | lr {lr_text(record)} | trainable "
        f"{p['trainable']:,} of {p['total']:,} parameters | max length "
        f"{record.get('config', 'data', 'max_length')} | precision {policy.name} ({policy.summary})"
        + auto_text(record.get("plan", default=None))
        + (f" | attention: {fallback}" if fallback else "")
    )


def auto_text(plan: dict | None) -> str:
    """What `auto` chose (run.json `plan`, finetune/training/planned.py) and against what memory; "" without auto."""
    if not plan or not plan["auto"]:
        return ""
    levers = plan["levers"]
    b, a = levers["per_device_train_batch_size"], levers["gradient_accumulation_steps"]
    return (
        f" | auto ({', '.join(plan['auto'])}): micro-batch {b['planned']} x accumulation {a['planned']} = "
        f"{plan['sequences_per_device_step']} sequences per device per step (kept), gradient checkpointing "
        f"{'on' if levers['gradient_checkpointing']['planned'] else 'off'}, {plan['predicted_gib']:.2f} GiB "
        f"planned = {plan['fraction']:.0%} of {plan['memory_basis']}"
    )


def sizes(record: RecordView) -> str:
    """World size, mesh and data-parallel size, each by its name (docs/parallelism.md): the effective
    batch and the LR scaling count data-parallel ranks, world size / (sp x tp x cp)."""
    mesh = {k: record.get("config", "parallel", f"{k}_size", default=None) or 1 for k in ("sp", "tp", "cp")}
    dp, world = record.get("batch", "data_parallel_size"), record.get("strategy", "world_size", default=None)
    return (
        f"world size {world or dp} (mesh dp {dp} x sp {mesh['sp']} x tp {mesh['tp']} x cp {mesh['cp']}), "
        f"data-parallel size {dp}"
    )


def lr_text(record: RecordView) -> str:
    """The learning rate applied; with a mesh, for which data-parallel size and why."""
    lr, dp = record.get("lr"), record.get("batch", "data_parallel_size")
    world = record.get("strategy", "world_size", default=None) or dp
    why = "" if world == dp else f"; effective batch of data-parallel size {dp}: world size {world} / (sp x tp x cp)"
    return f"{lr['applied']:.3g} ({lr['rule']} scaling, factor {lr['factor']:.3g}{why})"


def print_summary(record: RecordView, run_dir: Path, model_dir: Path | None, method: str) -> None:
    """The table, from the run record of a completed run (rank 0)."""
    rows = _training_rows(record, method) + _speed_rows(record) + _evaluation_rows(record)
    rows += _time_rows(record)
    rows.append(("run directory", f"{run_dir}   (run.json, config.yaml)"))
    if model_dir:
        check = record.get("export", "check", default=None)
        rows.append(
            ("LoRA adapter" if method in ("lora", "qlora") else "model", f"{model_dir}{verified(model_dir, check)}")
        )
    merged = record.get("export", "merged", default=None)
    if merged:
        rows.append(("merged model", f"{merged['folder']}{verified(Path(merged['folder']), merged['check'])}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"run {record.get('run_name')} completed"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    print("\n".join(["", "=" * 78, *lines, "=" * 78]), flush=True)


def verified(folder: Path, check: dict | None) -> str:
    """'   (model/ verified: ...)': which check ran on the save and what it found (run.json `export.check`)."""
    if not check:
        return ""
    if check["kind"] == "off":
        return f"   ({folder.name}/ not verified: run.verify_export: off)"
    figures = (
        f"loss {check['saved_loss']:.4f} vs {check['reference_loss']:.4f}, largest logit difference "
        f"{check['max_logit_diff']:.2g} (tolerance {check['logit_tolerance']:.2g}), "
        if check.get("max_logit_diff") is not None
        else ""
    )
    return f"   ({folder.name}/ verified, {check['kind']} check: {figures}{check['tensors']} tensors, {check['seconds']:.0f} s)"


def _training_rows(record: RecordView, method: str) -> list[tuple[str, str]]:
    """Steps and batch, strategy, precision, learning rate, losses and tokens."""
    s, b = partial(record.get, "summary"), partial(record.get, "batch")
    tokens = (
        f"{s('total_trained_tokens'):,} of {s('total_input_tokens'):,} input tokens"
        if s("total_trained_tokens") is not None
        else "n/a (see run.json throughput.mfu_note)"
    )
    if record.get("summary", "resumed_from"):
        tokens += f" (whole run, {s('steps_counted')} of {s('steps')} steps counted)"
    losses = (f"{s('train_loss'):.4f}" if s("train_loss") is not None else "n/a") + (
        f", eval loss {s('eval_loss'):.4f}" if s("eval_loss") else ""
    )
    steps = (
        f"{s('steps')} (effective batch {b('effective')} = {b('per_device')} per device x "
        f"{b('grad_accum')} accumulation x data-parallel size {b('data_parallel_size')})"
    )
    st = partial(record.get, "strategy")
    engaged = f"{st('name')} ({st('distributed_type')}), {method}{_set_up_by(st('set_up_by', default=None))}"
    return [
        ("steps", steps),
        ("sizes", sizes(record)),
        ("strategy", engaged),
        ("precision", precision_line(record)),
        ("learning rate", lr_text(record)),
        ("train loss", losses),
        ("trained tokens", tokens),
    ]


def _time_rows(record: RecordView) -> list[tuple[str, str]]:
    """The wall time, and for a resumed run the whole run's over its segments and how it resumed."""
    s = partial(record.get, "summary")
    this = f"{s('wall_s'):.0f} s (training {s('train_s'):.0f} s)"
    segments = record.get("resumes", default=[])
    if not s("resumed_from", default=None):
        return [("wall time", this)]
    whole = f"{s('run_wall_s'):.0f} s" if s("run_wall_s", default=None) is not None else "n/a (segments not timed)"
    trained = s("steps") - s("resumed_at_step")
    return [
        ("resumed", f"{s('resumes')} time(s), last from {s('resumed_from')} at step {s('resumed_at_step')}"),
        ("wall time", f"{whole} over {len(segments)} segments; this launch {this}, steps {trained} of {s('steps')}"),
    ]


def _speed_rows(record: RecordView) -> list[tuple[str, str]]:
    """Throughput and MFU (when measured), and the memory peaks."""
    tp = partial(record.get, "throughput")
    rows = []
    if tp("trained_tokens_per_s") is not None:
        rows.append(
            (
                "throughput",
                f"{tp('trained_tokens_per_s'):,.1f} trained tokens/s, {tp('input_tokens_per_s'):,.1f} "
                f"input tokens/s, median step {tp('median_step_s'):.2f} s over "
                f"{tp('steps_measured')} step(s) ({tp('warmup_steps_excluded')} warm-up excluded; "
                f"step clock only: no data loading, logging, evaluation or saves)",
            )
        )
        mfu = f"{100 * tp('mfu'):.1f}% of {tp('peak_device')}" if tp("mfu") is not None else None
        rows.append(("MFU", mfu or "n/a (" + (tp("mfu_note") or "no peak figure") + ")"))
    device, host = (record.get("memory", "max", k) for k in ("device_peak_allocated_gib", "host_peak_rss_gib"))
    device = f"device {device:.2f} GiB allocated, " if device is not None else ""
    rows.append(("peak memory", f"{device}host RSS {host or 0:.2f} GiB (max over ranks)"))
    return rows


def _evaluation_rows(record: RecordView) -> list[tuple[str, str]]:
    """Exact match before and after training, per task when there are several."""
    after = record.get("eval", "exact_match_after")
    if after is None:
        return []
    before = record.get("eval", "exact_match_before")
    was = f"{100 * before:.1f}% -> " if before is not None else ""
    rows = [
        (
            "exact match",
            f"{was}{100 * after:.1f}% on {record.get('eval', 'details', 'after', 'total')} held-out prompts",
        )
    ]
    per_task = record.get("eval", "details", "after", "per_task", default={})
    if len(per_task) > 1:
        pre = record.get("eval", "details", "before", "per_task", default={})
        shown = (
            f"{t} {100 * pre[t]:.0f}->{100 * v:.0f}%" if t in pre else f"{t} {100 * v:.0f}%"
            for t, v in per_task.items()
        )
        rows.append(("  per task", ", ".join(shown)))
    return rows


def _set_up_by(value: str | None) -> str:
    """How the strategy was set up (finetune/launch/strategy_setup.py), in words."""
    words = {
        "recipe": "set up by the recipe",
        "launcher-config": "set up by the accelerate config",
        "launcher-processes": "as the launcher's processes gave it",
    }
    return f", {words.get(value, value)}" if value else ""


def precision_line(record: RecordView) -> str:
    """'bf16-mixed (fp32 master + states, bf16 compute, reduce fp32)', from what the live run showed."""
    p = partial(record.get, "precision")
    if p("policy") is None:
        return "n/a (no precision section in the record)"
    if p("param_dtype") is None:
        return f"{p('policy')} (not read from the live run: training never began)"
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    parts = [
        f"{short.get(p('param_dtype'), p('param_dtype'))} " + ("master" if p("master_weights") else "params"),
        f"{short.get(p('optimizer_state_dtype'), p('optimizer_state_dtype'))} states",
        f"{short.get(p('compute_dtype'), p('compute_dtype'))} compute",
    ]
    if p("reduce_dtype"):
        parts.append(f"reduce {short.get(p('reduce_dtype'), p('reduce_dtype'))}")
    requested = " from auto" if p("requested") == "auto" else ""
    return f"{p('policy')}{requested} ({', '.join(parts)})"
