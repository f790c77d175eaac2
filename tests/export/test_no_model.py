"""`finetune export RUN` of a run that ended without writing model/ (stopped, failed, killed: model/ is written at the
end): the newest complete checkpoint is exported, said with why (model/ does not exist, what run.json's status says)
and the complete checkpoints another `--checkpoint N` can name; with none complete, refused naming each checkpoint's
problem. Before: "model/ holds no weights", which reads as a damaged model/, and no checkpoint listed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, finetune_train, short_demo

pytestmark = pytest.mark.integration


def _export(run, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "finetune.cli", "export", str(run), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)


def _status(run, status: str) -> None:
    record = json.loads((run / "run.json").read_text())
    record["summary"]["status"] = status
    (run / "run.json").write_text(json.dumps(record))


def test_a_run_without_model_exports_its_newest_complete_checkpoint_or_names_why_not(tmp_path, tiny_model_dir):
    from finetune.checkpointing import checkpoints

    run = tmp_path / "run"
    args = short_demo(tiny_model_dir, 2, "--training.save_strategy=steps", "--training.save_steps=1")
    code, out = finetune_train([*args, f"--run.output_dir={run}"], cwd=tmp_path)
    assert code == 0, out[-3000:]
    shutil.rmtree(run / "model")  # as a run stopped before its end leaves it
    _status(run, "interrupted")
    proc = _export(run, "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = " ".join(proc.stdout.split())
    assert f"{run / 'model'} does not exist (run.json summary.status: interrupted: it was stopped" in said, said
    assert f"exporting the newest complete checkpoint {run / 'checkpoint-2'} (complete checkpoints: 1, 2;" in said
    assert f"another: `finetune export {run} --checkpoint N`)" in said and "holds no weights" not in said, said

    for ckpt in checkpoints.checkpoints(run):  # saves cut short: no checkpoint is complete
        (ckpt / checkpoints.MARKER).unlink()
    _status(run, "failed")
    proc = _export(run, "--out", str(tmp_path / "refused"))
    assert proc.returncode == 2 and not (tmp_path / "refused").exists(), proc.stderr
    said = " ".join(proc.stderr.split())
    assert "model/ does not exist (run.json summary.status: failed: it failed before writing model/" in said, said
    assert f"no checkpoint is complete (checkpoint-1: no {checkpoints.MARKER}" in said, said
    assert f"; checkpoint-2: no {checkpoints.MARKER}" in said and "Traceback" not in proc.stderr, said
