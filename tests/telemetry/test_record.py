"""The run record's owner (finetune/telemetry/record.py): its declarations match the contract in
docs/run_record.md field for field, writers cannot add undeclared fields, readers cannot ask for
them, and a new record has the shape (keys, order) records have always had."""

from __future__ import annotations

import json

import pytest

from finetune.telemetry import record
from finetune.telemetry.record import RecordView, RunRecord
from tests.conftest import save_record
from tests.telemetry.run_record_doc import declared_paths, documented


def test_the_doc_and_the_declarations_name_the_same_fields():
    doc, declared = set(documented()), declared_paths()
    assert doc - declared == set(), "documented in docs/run_record.md but not declared in record_schema.py"
    assert declared - doc == set(), "declared in record_schema.py but not documented in docs/run_record.md"


def test_every_documented_field_has_a_presence():
    for path, present in documented().items():
        assert present, path


@pytest.fixture
def rec(tmp_path):
    return RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={"model": {"name_or_path": "m"}})


def test_a_new_record_has_the_schema_1_shape(rec):
    """The keys and their order as records were written before the record had an owner (+ precision, issue 12)."""
    assert list(rec.data) == [
        "schema",
        "run_name",
        "recipe",
        "created",
        "config",
        "versions",
        "hardware",
        "strategy",
        "precision",
        "batch",
        "lr",
        "memory",
        "predicted_memory",
        "throughput",
        "data",
        "steps",
        "summary",
        "eval",
    ]
    assert rec.data["summary"] == {
        "train_loss": None,
        "eval_loss": None,
        "total_trained_tokens": None,
        "wall_s": None,
        "steps": 0,
        "status": "running",
        "error": None,
    }
    assert record.check(rec.data) is None
    rec.set(
        "faults",
        {"collective_timeout_s": 60, "on_nonfinite": "stop", "max_nonfinite_skips": 1, "save_total_limit": None},
    )
    rec.set("parameters", {"trainable": 1, "total": 2})
    assert list(rec.data)[-2:] == ["faults", "parameters"]  # appended when first written, as before
    save_record(rec)
    assert json.loads(rec.path.read_text()) == json.loads(json.dumps(rec.data))


def test_writers_cannot_add_undeclared_fields(rec):
    with pytest.raises(ValueError, match="lr: field.*'warmup'.*not declared"):
        rec.set("lr", {"base": 1e-3, "rule": "none", "reference_batch": 8, "factor": 1.0, "applied": 1e-3, "warmup": 5})
    with pytest.raises(ValueError, match=r"strategy.evidence: field.*'engine'"):
        rec.set("strategy", {"name": "ddp", "evidence": {"engine": "DDP"}})
    with pytest.raises(ValueError, match="summary: field.*'status_code'"):
        rec.update("summary", status_code=3)
    with pytest.raises(ValueError, match=r"steps\[\]: field.*'tokens'"):
        rec.add_step({"step": 1, "tokens": 5})
    with pytest.raises(KeyError, match="no section 'kernels'"):
        rec.set("kernels", {})
    assert rec.data["lr"] is None and rec.data["steps"] == []  # nothing was written
    rec.add_step({"step": 1, "loss": 2.0})
    rec.update("summary", steps=1, status="completed")
    assert rec.view.get("steps")[0]["loss"] == 2.0 and rec.view.status == "completed"


def test_readers_cannot_ask_for_undeclared_fields(rec):
    view = RecordView(rec.data)
    assert view.get("throughput", "mfu") is None  # declared, null in a new record
    assert view.get("config", "model", "name_or_path") == "m"  # free-form below config
    assert view.get("summary", "status") == "running" and view.get("memory", "max", default={}) == {}
    with pytest.raises(KeyError, match="throughput has no field 'mfu_percent'"):
        view.get("throughput", "mfu_percent")
    with pytest.raises(KeyError, match="no section 'thruput'"):
        view.get("thruput")
