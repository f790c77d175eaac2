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
