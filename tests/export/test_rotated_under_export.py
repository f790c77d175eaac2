"""`finetune export RUN --checkpoint N` while the run trains and rotates its checkpoints (training.save_total_limit):
the checkpoint can be deleted under the export. A real run, stopped once (SIGTERM: checkpoint-K) and resumed, is live;
the slow_export drill holds `finetune export RUN --checkpoint K` open 5 s once its inputs are checked (checkpoint-K
complete), and a SIGTERM then makes the run save a newer checkpoint and rotate K out (save_total_limit 1). The export
fails with one message naming the checkpoint deleted, the rotation and the checkpoints kept now, exit 2, nothing at
--out and no partial folder beside it. Before: a traceback (KeyError: the deleted files' tensors not found)."""

from __future__ import annotations

import signal
import sys

import pytest

from finetune.errors import EXIT_PREEMPTED
from tests.conftest import REPO, Started, short_demo, steps_logged

pytestmark = pytest.mark.integration


def test_a_checkpoint_rotated_out_under_its_export_fails_it_clearly(tmp_path, tiny_model_dir):
    from finetune.checkpointing import checkpoints

    run, out = tmp_path / "run", tmp_path / "exported"
    args = short_demo(tiny_model_dir, 400, "--training.save_steps=1000", "--training.save_total_limit=1")
    args += ["--training.logging_steps=1", f"--run.output_dir={run}"]
    train = [sys.executable, "-m", "finetune.cli", "train", *args]
    with Started(train, cwd=tmp_path, env={}, out=tmp_path / "log") as job:  # stopped: its one checkpoint
        job.wait_until(lambda: steps_logged(run) >= 1, "a step logged")
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish() == EXIT_PREEMPTED, job.output[-3000:]
    (ckpt,) = checkpoints.checkpoints(run)
    step = checkpoints.step_of(ckpt)

    env = {"FINETUNE_FAULT_INJECT": "slow_export@rank0,step0", "PYTHONPATH": str(REPO)}
    export = [sys.executable, "-m", "finetune.cli", "export", str(run), "--checkpoint", str(step), "--out", str(out)]
    with Started([*train, "--resume"], cwd=tmp_path, env={}, out=tmp_path / "log") as job:  # live again
        job.wait_until(lambda: steps_logged(run) > step, "a step trained after the resume")
        with Started(export, cwd=REPO, env=env, out=tmp_path / "export.log") as exporting:
            exporting.wait_until(lambda: "holds the export open" in exporting.output, "the export held open")
            job.proc.send_signal(signal.SIGTERM)  # the run saves a newer checkpoint and rotates checkpoint-K out
            assert job.finish() == EXIT_PREEMPTED, job.output[-3000:]
            assert not ckpt.exists() and checkpoints.checkpoints(run), job.output[-3000:]
            code, said = exporting.finish(), exporting.output
    assert code == 2 and "Traceback" not in said, said[-4000:]
    said = " ".join(said.split())
    assert f"--checkpoint {step}: {ckpt} was deleted while it was exported" in said, said
    kept = checkpoints.checkpoints(run)[-1].name
    assert f"(training.save_total_limit=1). Export one it keeps (complete now: {kept})" in said, said
    assert f"nothing was written to {out}" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.log", "log", "run"], list(tmp_path.iterdir())
