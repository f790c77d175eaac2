"""The planner against six H200 measurements (issue 13): Llama-3.2-1B shape, micro-batch 16 x 512
tokens, full fine-tuning under single, FSDP2, ZeRO-2 and ZeRO-3 (world size 1), LoRA and QLoRA.

The records (tests/planning/data/gpu_records_2026-11-22/, the GPU runs' own run.json files,
unchanged) are the expected values: peak allocated and reserved
device memory, and the host's training-peak RSS, measured by the run; nothing here comes from the
planner. Each record is predicted under the regime it ran (regimes.json, with evidence: they
predate training.precision), which the planner's legacy rules must reproduce from the record alone.
The control predicts the same six under today's default policy (bf16-mixed) instead: that misses,
so the test is sensitive to the regime, not tuned to pass whatever it is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.planning import prediction, regimes
from finetune.planning.shapes import Workload, shape_of
from finetune.strategies import planner_key

DATA = Path(__file__).parent / "data" / "gpu_records_2026-11-22"
STATED = json.loads((DATA / "regimes.json").read_text())["records"]
NAMES = sorted(STATED)
ISSUE_TOLERANCE = 0.15  # device allocated and reserved (issue 13)
HOST_TOLERANCE = 0.25  # host training peak (issue 13)
# The mechanism reaches these six to < 0.1% on allocated (docs/planning.md); a drift beyond 2% means a
# component changed, which this catches long before the issue's 15% would.
REGRESSION_GUARD = 0.02


def shape():
    from transformers import AutoConfig

    spec = json.loads((DATA / "Llama-3.2-1B.json").read_text())
    kind = spec.pop("model_type")
    spec.pop("architectures", None)
    return shape_of(AutoConfig.for_model(kind, **spec))


def workload(rec: dict, precision: str = "legacy") -> Workload:
    """The record's own configuration (pre-issue-14 runs: the standard loss; every example was cut to
    max_length, so no batch carried padding)."""
    c = rec["config"]
    m, d = c["method"], rec["data"]
    return Workload(
        method=m["name"],
        micro_batch=c["training"]["per_device_train_batch_size"],
        seq_len=c["data"]["max_length"],
        grad_accum=c["training"]["gradient_accumulation_steps"],
        precision=precision,
        lora_r=m["lora_r"],
        lora_targets=m["target_modules"],
        double_quant=m["double_quant"],
        attn_implementation=c["model"]["attn_implementation"],
        masked=d["truncated"] < d["train_examples"],
        loss_impl="standard",
        legacy_model_dtype=c["model"]["dtype"],
    )


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.run.json").read_text())


def predict(name: str, regime: regimes.Regime):
    rec, stated = load(name), STATED[name]
    strategy = planner_key(rec["strategy"]["name"], rec["strategy"]["offload"])
    ds = json.loads((DATA / stated["ds_config"]).read_text()) if stated["ds_config"] else None
    out = prediction.predicted_memory(
        shape(),
        workload(rec),
        strategy,
        rec["strategy"]["world_size"],
        sm=stated["sm"],
        seq_len_source="the record's data.max_length",
        ds_config=ds,
        regime=regime,
    )
    return rec, prediction.add_error(out, rec["memory"])


def recorded_regime(record: dict, strategy: str) -> regimes.Regime:
    """The regime of a record that predates the precision policy: the legacy rules for its device
    type and model.dtype."""
    device = (record.get("hardware") or {}).get("device_type") or "cuda"
    dtype = ((record.get("config") or {}).get("model") or {}).get("dtype") or "auto"
    return regimes.legacy_regime(record["config"]["method"]["name"], strategy, device, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_the_legacy_rules_give_the_regime_each_record_ran(name):
    rec = load(name)
    assert "precision" not in rec  # these runs predate the policy
    got = recorded_regime(rec, STATED[name]["strategy"])
    stated = STATED[name]["regime"]
    assert {k: getattr(got, k) for k in stated} == stated, STATED[name]["evidence"]


@pytest.mark.parametrize("name", NAMES)
def test_each_record_within_the_issue_tolerance(name):
    rec = load(name)
    got = recorded_regime(rec, STATED[name]["strategy"])
    _, pred = predict(name, got)
    err = pred["error"]
    assert pred["phase"] == "backward_start"  # the standard loss's three fp32 T x V buffers
    assert abs(err["device_allocated"]["relative_error"]) <= ISSUE_TOLERANCE
    assert abs(err["device_allocated"]["relative_error"]) <= REGRESSION_GUARD, err["device_allocated"]
    assert abs(err["device_reserved"]["relative_error"]) <= ISSUE_TOLERANCE, err["device_reserved"]
    assert abs(err["host"]["relative_error"]) <= HOST_TOLERANCE, err["host"]
    # the error is the record's own measurement against the prediction, nothing else
    measured = rec["memory"]["max"]
    assert err["device_allocated"]["measured_gib"] == measured["device_peak_allocated_gib"]
    assert err["device_reserved"]["measured_gib"] == measured["device_peak_reserved_gib"]
    assert err["host"]["measured_gib"] == measured["host_peak_rss_gib"]


def test_control_the_default_policy_instead_of_the_regime_they_ran_misses():
    """Predicting the six under bf16-mixed (fp32 master and states, autocast; DeepSpeed bf16) instead
    of what they ran: at least four miss by more than the issue's 15%, so the passing test above
    depends on modelling the right regime, and is not loose enough to pass anything."""
    misses = {}
    for name in NAMES:
        rec = load(name)
        strategy = planner_key(rec["strategy"]["name"], rec["strategy"]["offload"])
        wrong = regimes.policy_regime("bf16-mixed", rec["config"]["method"]["name"], strategy)
        _, pred = predict(name, wrong)
        misses[name] = pred["error"]["device_allocated"]["relative_error"]
    assert sum(abs(e) > ISSUE_TOLERANCE for e in misses.values()) >= 4, misses
