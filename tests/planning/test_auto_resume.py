"""Issue 47: a run started with `auto` levers and resumed with the same command continues with the values its
plan resolved (run.json `plan`), says so, and still refuses a real change. A real one-process CPU run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import finetune_train
from tests.training.test_train_e2e import tiny_args

pytestmark = pytest.mark.integration

AUTO = ["--training.per_device_train_batch_size=auto", "--training.gradient_checkpointing=auto"]


def test_a_resumed_auto_run_takes_its_recorded_resolution(tmp_path, tiny_model_dir):
    args = tiny_args(
        tiny_model_dir, *AUTO, "--training.save_strategy=steps", "--training.save_steps=2", "--run.name=auto"
    )
    code, out = finetune_train(args, tmp_path)
    run_dir = tmp_path / "runs" / "auto"
    assert code == 0, out[-4000:]
    plan = json.loads((run_dir / "run.json").read_text())["plan"]
    planned = {k: v["planned"] for k, v in plan["levers"].items()}
    assert plan["auto"] == ["per_device_train_batch_size", "gradient_checkpointing"]
    # the demo recipe's 8 sequences per step, kept whatever micro-batch fits (one process)
    assert plan["effective_batch"]["asked"] == plan["effective_batch"]["planned"] == 8

    # the last checkpoint torn: the same command with --resume continues from checkpoint-2
    (run_dir / "checkpoint-3" / "finetune-checkpoint-complete.json").unlink()
    code, out = finetune_train([*args, "--resume"], tmp_path)
    assert code == 0, out[-4000:]
    said = " ".join(out.split())
    assert "auto resumed as the run resolved it (run.json plan):" in said, out[-4000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["summary"]["status"] == "completed" and record["summary"]["resumed_from"].endswith("checkpoint-2")
    assert {k: v["planned"] for k, v in record["plan"]["levers"].items()} == planned
    assert record["batch"]["per_device"] == planned["per_device_train_batch_size"]
    taken = record["resumes"][-1]["auto_resolved"]
    assert taken == {f"training.{k}": v for k, v in planned.items()}  # accumulation comes with the micro-batch

    # a real change of a lever is still refused
    (run_dir / "checkpoint-3" / "finetune-checkpoint-complete.json").unlink(missing_ok=True)
    flipped = str(not planned["gradient_checkpointing"]).lower()
    code, out = finetune_train([*args, f"--training.gradient_checkpointing={flipped}", "--resume"], tmp_path)
    assert code == 2, out[-4000:]
    assert "training.gradient_checkpointing" in out and "--allow-config-change" in out
