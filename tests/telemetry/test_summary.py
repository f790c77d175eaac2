"""The console summary's precision row (finetune/telemetry/summary.py), from hand-written record sections."""

from __future__ import annotations

from finetune.telemetry.record import RecordView
from finetune.telemetry.summary import precision_line


def _view(**precision) -> RecordView:
    base = {
        "policy": "bf16-mixed",
        "requested": "auto",
        "family": "fsdp2",
        "load_dtype": "bfloat16",
        "param_dtype": "float32",
        "compute_dtype": "bfloat16",
        "optimizer_state_dtype": "float32",
        "master_weights": True,
        "reduce_dtype": "float32",
        "observed_compute_dtype": "bfloat16",
        "warning": None,
        "evidence": {},
    }
    return RecordView({"precision": {**base, **precision}})


def test_the_precision_row_says_what_the_live_run_held():
    assert precision_line(_view()) == "bf16-mixed from auto (fp32 master, fp32 states, bf16 compute, reduce fp32)"
    assert (
        precision_line(
            _view(
                policy="bf16-true",
                requested="bf16-true",
                param_dtype="bfloat16",
                optimizer_state_dtype="bfloat16",
                master_weights=False,
                reduce_dtype=None,
            )
        )
        == "bf16-true (bf16 params, bf16 states, bf16 compute)"
    )
    assert precision_line(_view(param_dtype=None)) == "bf16-mixed (not read from the live run: training never began)"
    assert precision_line(RecordView({"precision": None})) == "n/a (no precision section in the record)"


def test_the_console_prints_our_log_lines_not_trainers_dicts():
    """Trainer's end-of-training dict was printed raw (after a resume its train_loss, of the last
    segment, contradicted the summary's); the evaluation's dict too. One compact line per log step."""
    from types import SimpleNamespace

    from finetune.training.trainer import CompactProgress

    bar = SimpleNamespace(lines=[])
    bar.write = bar.lines.append
    progress = CompactProgress()
    progress.training_bar = bar
    state = SimpleNamespace(is_world_process_zero=True, global_step=4, max_steps=4)
    step = {"loss": 1.5, "learning_rate": 1e-3, "perf/step_s": 2.0, "memory/max_host_peak_rss_gib": 1.0}
    for logs in (step, {"eval_loss": 1.25, "eval_runtime": 3.0}, {"train_runtime": 9.0, "train_loss": 1.7}):
        progress.on_log(None, state, None, logs=dict(logs))
    assert bar.lines == [
        "step 4/4 | loss 1.5000 | lr 0.001 | 2.00 s/step | host 1.00 GiB",
        "step 4/4 | eval loss 1.2500",
    ]
