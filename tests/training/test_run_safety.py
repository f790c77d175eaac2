"""A run as a user starts it, with a name that is not plain (spaces, `#`, `:`, unicode): it goes to
runs/<name> exactly, said before training; `--resume` of the completed run changes nothing; a run.json
left half-written is named, kept aside, and the run resumes from its newest complete checkpoint."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from finetune.launch import rundir
from tests.conftest import finetune_train
from tests.training.test_train_e2e import tiny_args

pytestmark = pytest.mark.integration

NAME = "my run #2: ünï"


def _hashes(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def test_a_named_run_its_finished_resume_and_a_half_written_record(tmp_path, tiny_model_dir):
    args = tiny_args(tiny_model_dir, "--training.save_strategy=steps", "--training.save_steps=2", f"--run.name={NAME}")
    code, out = finetune_train(args, tmp_path)
    run_dir = tmp_path / "runs" / NAME
    assert code == 0, out[-4000:]
    pointer = f"[finetune] run directory: {run_dir} (any third-party warnings: third_party.log)\n"
    assert out.index(pointer) < out.index("exact match before training")
    # our lines only: torch's warning kept in the run's log, transformers' bars and Trainer's dict gone
    for theirs in ("pin_memory", "Loading weights", "Writing model shards", "{'train_runtime'"):
        assert theirs not in out, theirs
    assert "UserWarning: 'pin_memory' argument is set as true" in (run_dir / "third_party.log").read_text()
    record = json.loads((run_dir / "run.json").read_text())
    assert record["run_name"] == NAME and record["summary"]["status"] == "completed"
    assert (run_dir / rundir.MARKER).is_file() and (run_dir / "model").is_dir()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [NAME]

    # --resume of the completed run: before, "nothing left to train", then model/ rewritten and run.json appended
    before = _hashes(run_dir)
    code, out = finetune_train(["--recipe", "demo", f"--run.name={NAME}", "--resume"], tmp_path)
    assert code == 0, out[-4000:]
    assert f"the run in runs/{NAME} completed (step 3); there is nothing to resume and nothing was changed" in out
    assert "accelerate launch" not in out and _hashes(run_dir) == before

    # a crash while the last checkpoint and run.json were written: checkpoint-3 has no completion marker, run.json
    # is cut in half. Before: a JSONDecodeError traceback.
    (run_dir / "checkpoint-3" / "finetune-checkpoint-complete.json").unlink()
    half = (run_dir / "run.json").read_bytes()[:4000]
    (run_dir / "run.json").write_bytes(half)
    code, out = finetune_train(["--recipe", "demo", f"--run.name={NAME}", "--resume"], tmp_path)
    assert code == 0, out[-4000:]
    assert f"runs/{NAME}/run.json is not valid JSON (line" in out
    assert (run_dir / "run.damaged1.json").read_bytes() == half
    record = json.loads((run_dir / "run.json").read_text())
    assert record["summary"]["status"] == "completed" and record["summary"]["steps"] == 3
    assert record["summary"]["resumed_from"].endswith("checkpoint-2")
    assert (run_dir / "checkpoint-3.superseded-1").is_dir()  # set aside, not deleted
