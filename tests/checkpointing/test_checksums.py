"""A checkpoint file damaged without changing its size (issue 23, category 5): the completion marker
records each file's checksum, choosing a checkpoint to resume from verifies them, and a damaged one is
skipped with a warning like a torn one, so the newest intact checkpoint is used (on main the damaged
newest one was chosen: sizes matched). Rotation at every save checks sizes only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.checkpointing import checkpoints
from finetune.errors import UserError


def fake_checkpoint(run_dir: Path, step: int) -> Path:
    ckpt = run_dir / f"checkpoint-{step}"
    (ckpt / "global_step").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (ckpt / "global_step" / "shard_0.pt").write_bytes(bytes(range(256)) * 4)
    checkpoints.write_marker(ckpt, step=step, world_size=1)
    return ckpt


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_file_damaged_in_place_is_skipped_for_the_newest_intact_checkpoint(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    marker = json.loads((newest / checkpoints.MARKER).read_text())
    assert marker["checksums"]["algorithm"] == "xxh3_128"
    assert set(marker["checksums"]["files"]) == set(marker["files"]) == {"trainer_state.json", "global_step/shard_0.pt"}
    assert checkpoints.newest_valid(tmp_path) == newest  # control: intact
    flip_a_byte(newest / "global_step" / "shard_0.pt")  # same size
    with caplog.at_level("WARNING", logger="finetune"):
        assert checkpoints.newest_valid(tmp_path) == tmp_path / "checkpoint-2"
    assert (
        "skipping checkpoint " + str(newest) + ": file global_step/shard_0.pt does not match the xxh3_128 checksum "
        "recorded when saved (damaged on disk since)"
    ) in caplog.text
    with pytest.raises(
        UserError, match="cannot resume from this checkpoint: file global_step/shard_0.pt does not match"
    ):
        checkpoints.resolve(str(newest), tmp_path)  # --resume=PATH of the damaged one
    flip_a_byte(tmp_path / "checkpoint-2" / "trainer_state.json")
    with pytest.raises(UserError, match="no complete checkpoint in .* every one is incomplete or damaged"):
        checkpoints.resolve("auto", tmp_path)


def test_a_marker_written_before_checksums_is_still_accepted(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 3)
    marker = json.loads((ckpt / checkpoints.MARKER).read_text())
    del marker["checksums"]
    (ckpt / checkpoints.MARKER).write_text(json.dumps(marker))
    flip_a_byte(ckpt / "global_step" / "shard_0.pt")
    assert checkpoints.problem(ckpt) is None  # sizes only, as before


def test_rotation_checks_sizes_without_reading_every_checkpoint_again(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    newest = fake_checkpoint(tmp_path, 4)
    read: list[Path] = []
    monkeypatch.setattr(checkpoints.fingerprints, "checksum", lambda path: read.append(path) or "")
    assert [p.name for p in checkpoints.rotate(tmp_path, 2, newest)] == ["checkpoint-1", "checkpoint-2"]
    assert read == []
