"""The full `finetune doctor` on this machine (the CPU rehearsal without a GPU: every strategy on 2
gloo processes), and its control: one strategy misconfigured on purpose (a doubled learning rate
through --override), which the loss comparison must report, exit 1.

What the doctor says is checked against the run records themselves: each run.json is read here and
the largest per-step relative loss difference recounted, the engaged evidence read again.

The control's doctor runs in this process on a copy of the full doctor's --out: its misconfigured
run is launched for real, while the reference run (`single`, the same command on the same model and
data) and the links section are the full doctor's own, reused rather than run a second time."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from types import SimpleNamespace

import pytest

from finetune.cli import dispatch
from finetune.doctor import main as doctor_main
from finetune.doctor import runs
from tests.conftest import REPO, run_process_group

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor")
    env = {**os.environ, "HF_HOME": str(base / "hf_home"), "PYTHONUNBUFFERED": "1"}
    env.pop("FINETUNE_CPU_DISTRIBUTED", None)
    start = time.monotonic()
    code, out, _ = run_process_group(
        [sys.executable, "-m", "finetune.cli", "doctor", "--out", str(base / "full")],
        cwd=REPO,
        env=env,
        timeout=900,
        merge_stderr=True,
    )
    print(f"finetune doctor: exit {code} after {time.monotonic() - start:.0f} s")
    result = json.loads((base / "full" / "doctor.json").read_text())
    return SimpleNamespace(code=code, out=out, result=result, dir=base / "full")


def recounted_max_rel(ref_dir, run_dir) -> float:
    def losses(d):
        return [s["loss"] for s in json.loads((d / "run.json").read_text())["steps"] if s.get("loss") is not None]

    ref, got = losses(ref_dir), losses(run_dir)
    assert len(ref) == len(got) == runs.STEPS
    return max(abs(a - b) / abs(a) for a, b in zip(ref, got))


def test_the_full_doctor_passes_with_every_strategy_engaged_and_agreeing(full):
    code, out, result = full.code, full.out, full.result
    assert code == 0 and result["ok"], out[-6000:]
    assert "all well:" in out and (full.dir / "doctor.html").is_file()
    s = result["strategies"]
    assert set(s["skipped"]) <= {"ddp"}  # on one GPU (DDP needs 2 ranks); on CPU and on 2+ GPUs nothing
    assert [r["name"] for r in s["runs"]] == [
        n for n in ["single", "ddp", "zero2", "zero3", "fsdp"] if n not in s["skipped"]
    ]
    world = s["world_size"]
    for entry in s["runs"]:
        run_dir = full.dir / "runs" / entry["name"]
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
            worst = recounted_max_rel(full.dir / "runs" / "single", run_dir)
            assert entry["comparison"]["max_loss_rel"] == pytest.approx(worst, rel=1e-9, abs=1e-15)
            assert worst <= s["tolerance"]["loss"]
            print(f"{entry['name']}: largest relative loss difference to single {worst:.1e}")
    link_ops = [x["name"] for x in result["lines"] if x["section"] == "links"]
    assert link_ops == ["all_reduce", "all_gather", "reduce_scatter"]


def test_the_control_a_misconfigured_strategy_is_reported_and_fails_the_doctor(full, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "control"
    shutil.copytree(full.dir, out_dir, symlinks=True)  # its marker, model/, data/, runs/, comm.json
    reference = next(r for r in full.result["strategies"]["runs"] if r["name"] == "single")
    execute = runs.execute

    def reuse_single(planned, out):
        if planned.name != "single":
            return execute(planned, out)  # the misconfigured run: launched
        # the full doctor's reference run, which this doctor would run again with the same command
        assert runs.shown(planned.command).replace(str(out_dir), str(full.dir)) == reference["command"]
        done = runs.Finished(planned.command, 0, reference["seconds"], out / "logs" / "single.log", [])
        return runs.Done(planned, done, json.loads((planned.run_dir / "run.json").read_text()))

    def reuse_links(dev, out):  # the full doctor's bench-comm report, described as the doctor does
        comm = json.loads((out / "comm.json").read_text())
        return doctor_main.describe_links(comm, dev), comm

    monkeypatch.setattr(runs, "execute", reuse_single)
    monkeypatch.setattr(doctor_main, "check_links", reuse_links)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("FINETUNE_CPU_DISTRIBUTED", raising=False)
    monkeypatch.chdir(REPO)
    code = dispatch.main(
        ["doctor", "--out", str(out_dir), "--strategies", "single,ddp", "--override", "ddp:training.learning_rate=2e-3"]
    )
    out = capsys.readouterr().out
    result = json.loads((out_dir / "doctor.json").read_text())
    assert code == 1 and not result["ok"], out[-6000:]
    (problem,) = result["problems"]
    assert problem["name"] == "ddp losses" and problem["section"] == "strategies"
    assert "loss differs from single by" in problem["detail"] and "lr.applied 0.002 != 0.001" in problem["detail"]
    assert problem["fix"].startswith("ddp trained differently from one process on the same data: finetune compare")
    worst = recounted_max_rel(out_dir / "runs" / "single", out_dir / "runs" / "ddp")
    assert worst > result["strategies"]["tolerance"]["loss"] and problem["data"]["max_loss_rel"] == pytest.approx(worst)
    assert "1 problem(s)" in out and "fix: ddp trained differently" in out
