"""The full `finetune doctor` on this machine (the CPU rehearsal without a GPU: every strategy on 2
gloo processes), and its control: one strategy misconfigured on purpose (a doubled learning rate
through --override), which the loss comparison must report, exit 1.

What the doctor says is checked against the run records themselves: each run.json is read here and
the largest per-step relative loss difference recounted, the engaged evidence read again."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from finetune.doctor import runs
from tests.conftest import REPO, run_process_group

pytestmark = pytest.mark.integration


def doctor(args, tmp_path, name):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "PYTHONUNBUFFERED": "1"}
    env.pop("FINETUNE_CPU_DISTRIBUTED", None)
    start = time.monotonic()
    code, out, _ = run_process_group(
        [sys.executable, "-m", "finetune.cli", "doctor", "--out", str(tmp_path / name), *args],
        cwd=REPO,
        env=env,
        timeout=900,
        merge_stderr=True,
    )
    print(f"finetune doctor {' '.join(args)}: exit {code} after {time.monotonic() - start:.0f} s")
    return code, out, json.loads((tmp_path / name / "doctor.json").read_text())


def recounted_max_rel(ref_dir, run_dir) -> float:
    def losses(d):
        return [s["loss"] for s in json.loads((d / "run.json").read_text())["steps"] if s.get("loss") is not None]

    ref, got = losses(ref_dir), losses(run_dir)
    assert len(ref) == len(got) == runs.STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


def test_the_full_doctor_passes_with_every_strategy_engaged_and_agreeing(tmp_path):
    code, out, result = doctor([], tmp_path, "full")
    assert code == 0 and result["ok"], out[-6000:]
    assert "all well:" in out and (tmp_path / "full" / "doctor.html").is_file()
    s = result["strategies"]
    assert set(s["skipped"]) <= {"ddp"}  # on one GPU (DDP needs 2 ranks); on CPU and on 2+ GPUs nothing
    assert [r["name"] for r in s["runs"]] == [
        n for n in ["single", "ddp", "zero2", "zero3", "fsdp"] if n not in s["skipped"]
    ]
    world = s["world_size"]
    for entry in s["runs"]:
        run_dir = tmp_path / "full" / "runs" / entry["name"]
        rec = json.loads((run_dir / "run.json").read_text())
        ev, n = rec["strategy"]["evidence"], 1 if entry["name"] == "single" else world
        assert rec["summary"]["status"] == "completed" and ev["world_size"] == rec["strategy"]["world_size"] == n
        assert entry["evidence"] == ev and rec["precision"]["policy"] == s["policy"]
        assert rec["batch"]["effective"] == runs.PER_DEVICE * world
        engine = {"ddp": "DistributedDataParallel", "zero2": "DeepSpeedEngine", "zero3": "DeepSpeedEngine"}
        if entry["name"] in engine:
            assert ev["engine_class"] == engine[entry["name"]]
        if entry["name"] == "fsdp":
            assert ev["dtensor_params"] == ev["params"] > 0
        if entry["name"] != "single":
            worst = recounted_max_rel(tmp_path / "full" / "runs" / "single", run_dir)
            assert entry["comparison"]["max_loss_rel"] == pytest.approx(worst, rel=1e-9, abs=1e-15)
            assert worst <= s["tolerance"]["loss"]
            print(f"{entry['name']}: largest relative loss difference to single {worst:.1e}")
    link_ops = [x["name"] for x in result["lines"] if x["section"] == "links"]
    assert link_ops == ["all_reduce", "all_gather", "reduce_scatter"]


def test_the_control_a_misconfigured_strategy_is_reported_and_fails_the_doctor(tmp_path):
    code, out, result = doctor(
        ["--strategies", "single,ddp", "--override", "ddp:training.learning_rate=2e-3"], tmp_path, "control"
    )
    assert code == 1 and not result["ok"], out[-6000:]
    (problem,) = result["problems"]
    assert problem["name"] == "ddp losses" and problem["section"] == "strategies"
    assert "loss differs from single by" in problem["detail"] and "lr.applied 0.002 != 0.001" in problem["detail"]
    assert problem["fix"].startswith("ddp trained differently from one process on the same data: finetune compare")
    worst = recounted_max_rel(tmp_path / "control" / "runs" / "single", tmp_path / "control" / "runs" / "ddp")
    assert worst > result["strategies"]["tolerance"]["loss"] and problem["data"]["max_loss_rel"] == pytest.approx(worst)
    assert "1 problem(s)" in out and "fix: ddp trained differently" in out
