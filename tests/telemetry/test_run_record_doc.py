"""A real run's run.json against its contract, docs/run_record.md, both ways: every field the run
wrote is documented, and every field documented `always` is there (tests/telemetry/test_record.py
checks the doc against the declarations). Multi-process records (DeepSpeed, FSDP2 evidence) are
checked the first way in tests/training/test_strategies.py."""

from __future__ import annotations

import copy

import pytest

from tests.telemetry.run_record_doc import documented, missing_always_fields, undocumented

pytestmark = pytest.mark.integration


def test_a_real_run_record_matches_the_doc_both_ways(strategy_runs):
    """The session's one-process run (tests/training/strategy_runs.py `single`: the demo recipe, evaluated)."""
    res = strategy_runs("single")
    rec, doc = res.record, documented()
    assert rec["summary"]["status"] == "completed" and rec["eval"]["details"]["after"]["total"] == 4
    assert undocumented(rec, doc) == []
    assert missing_always_fields(rec, doc) == []

    # Controls: the same checks notice a field the doc lacks, and a documented field the run lacks.
    extra = copy.deepcopy(rec)
    extra["throughput"]["tokens_per_joule"] = 1.0
    extra["steps"][0]["loss_scale"] = 1.0
    assert undocumented(extra, doc) == ["steps[].loss_scale", "throughput.tokens_per_joule"]
    lacking = copy.deepcopy(rec)
    del lacking["batch"]["effective"]
    del lacking["memory"]["per_rank"][0]["rank"]
    assert missing_always_fields(lacking, doc) == ["batch.effective", "memory.per_rank[].rank"]
