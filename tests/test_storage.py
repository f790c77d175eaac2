"""Filesystem failures told apart from bugs and named (finetune/storage.py): the errno, torch's and
safetensors' wordings of it, the path and the space left; a read-only directory found before launch."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from finetune import storage


def test_storage_failures_are_recognised_in_the_forms_the_libraries_raise(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "optimizer.pt"))
    assert storage.cause(full) == errno.ENOSPC
    assert storage.cause(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    rust = RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })')
    assert storage.cause(rust) == errno.ENOSPC
    try:  # wrapped, as Trainer re-raises
        try:
            raise full
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as wrapped:
        assert storage.cause(wrapped) == errno.ENOSPC
    # torch's writer drops the errno: a full disk only when the filesystem is (nearly) full
    torch_msg = RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
    assert storage.cause(torch_msg, tmp_path) is None  # this disk has room: not guessed
    # not storage failures: bugs keep their tracebacks
    assert storage.cause(OSError(errno.ENOENT, "No such file")) is None
    assert storage.cause(ValueError("bad value")) is None
    assert storage.error(ValueError("x"), tmp_path, "writing") is None


def test_the_message_names_what_failed_where_and_the_space_left(tmp_path):
    e = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "optimizer.pt"))
    failure = storage.error(e, tmp_path / "ckpt", "writing checkpoint ckpt", then="resume later")
    assert isinstance(failure, storage.StorageError) and failure.errno == errno.ENOSPC
    msg = str(failure)
    assert msg.startswith("writing checkpoint ckpt failed: no space left on device (")
    assert str(tmp_path / "ckpt" / "optimizer.pt") in msg and "free of" in msg and msg.endswith(". resume later")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no one may write into: a read-only tmpfs as root (root ignores permission bits),
    mode 0555 otherwise. Unmounted afterwards, also on failure."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_output_directory_is_found_before_anything_starts(read_only_dir):
    target = read_only_dir / "runs" / "exp"
    problem = storage.unwritable(target, "run directory")
    assert problem and f"run directory {target} cannot be written" in problem
    assert ("read-only file system" if os.geteuid() == 0 else "permission denied") in problem
    assert "--run.output_dir" in problem
    assert storage.unwritable(Path(read_only_dir).parent / "elsewhere", "run directory") is None


def test_a_run_json_the_disk_refuses_mid_run_is_said_once_and_training_goes_on(tmp_path, caplog, capsys):
    """The record's per-step write fails (ENOSPC): a warning, once; the steps stay in memory and are
    written when the disk has room again; at the end a failure is said on stderr. Any other error
    (a bug) still raises."""
    import errno as errnos

    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import RunJson

    rec = RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={})
    sink = RunJson(rec)
    real_write, full = sink.save, [True]

    def write():
        if full[0]:
            raise OSError(errnos.ENOSPC, "No space left on device", str(rec.path))
        real_write()

    sink.save = write
    with caplog.at_level("WARNING", logger="finetune"):
        sink.log({"step": 1, "loss": 2.0})
        sink.log({"step": 2, "loss": 1.5})
    assert caplog.text.count("no space left on device") == 1, caplog.text
    assert not rec.path.exists()
    full[0] = False
    sink.log({"step": 3, "loss": 1.0})
    assert [s["step"] for s in __import__("json").loads(rec.path.read_text())["steps"]] == [1, 2, 3]
    full[0] = True
    sink.close(rec.view, 0)
    assert "could not be updated with how the run ended" in capsys.readouterr().err
    sink.save = lambda: (_ for _ in ()).throw(OSError(errnos.ENOENT, "No such file"))
    with pytest.raises(OSError):
        sink.log({"step": 4, "loss": 0.5})


def test_bench_out_of_a_folder_bench_did_not_make_is_refused_untouched(tmp_path, monkeypatch):
    """`finetune bench --out .` wrote data.jsonl, report.json, report.md, models/ and runs/ over the
    user's files of those names; like `finetune doctor`'s, its --out is now a folder it made or a new one."""
    from finetune.bench import main as bench_main
    from finetune.errors import UserError

    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("data.jsonl", "report.md"):
        (mine / name).write_text("the user's")

    def loaded_a_tokenizer(*_):  # what comes next in the benchmark: building models, then writing into --out
        raise AssertionError("the benchmark went on")

    monkeypatch.setattr("finetune.modeling.load.load_tokenizer", loaded_a_tokenizer)
    with pytest.raises(UserError, match=r"--out .*mine: exists and was not made by finetune bench"):
        bench_main.run(bench_main.parse_args(["--out", str(mine), "--shape", "tiny", "--methods", "lora"]))
    assert sorted(p.name for p in mine.iterdir()) == ["data.jsonl", "report.md"]
    assert {p.read_text() for p in mine.iterdir()} == {"the user's"}
    made = tmp_path / "made"
    assert storage.own_directory(made, "finetune bench", "its files") == made  # new: made and marked
    assert storage.own_directory(made, "finetune bench", "its files") == made  # its own: reused


def test_what_is_put_in_place_from_a_temporary_file_or_folder_gets_the_umask_mode(tmp_path, monkeypatch):
    """run.json (written to a mkstemp file, then renamed) and `finetune export`'s folder (mkdtemp) were owner-only,
    0600 and 0700, whatever the umask: a team mate's `finetune compare` or a model server running as another user
    could not read them. Now they get what a plain open() or mkdir() gives under the umask read at import."""
    import tempfile

    from finetune.telemetry.record import RunRecord
    from finetune.telemetry.sinks import RunJson

    assert storage.UMASK == os.umask(storage.UMASK)  # read without changing it
    monkeypatch.setattr(storage, "UMASK", 0o022)
    RunJson(RunRecord(tmp_path / "run.json", run_name="r", recipe="demo", config={})).save()
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    storage.as_umask_allows(folder)
    monkeypatch.setattr(storage, "UMASK", 0o027)
    RunJson(RunRecord(tmp_path / "other.json", run_name="r", recipe="demo", config={})).save()
    assert (tmp_path / "run.json").stat().st_mode & 0o777 == 0o644
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "other.json").stat().st_mode & 0o777 == 0o640


def test_an_out_folder_that_cannot_be_made_is_said_and_nothing_is_left(tmp_path, monkeypatch):
    """`--out` under a file, or on a filesystem that refuses the folder: `finetune compare`, `sweep`, `doctor` and
    `bench` ended in a traceback (NotADirectoryError, PermissionError from mkdir), exit 1. Now one message names the
    path and why, and the folders made on the way are removed again."""
    from finetune.errors import UserError

    user_file = tmp_path / "notes.txt"
    user_file.write_text("the user's")
    with pytest.raises(UserError, match=rf"--out {user_file}/out: {user_file} is a file, not a folder; nothing was"):
        storage.make_directory(user_file / "out")
    for tool in ("finetune doctor", "finetune bench"):  # their --out, through own_directory
        with pytest.raises(UserError, match="is a file, not a folder"):
            storage.own_directory(user_file / "out", tool, "its files")
    assert user_file.read_text() == "the user's"

    real = Path.mkdir

    def refused(self, mode=0o777, parents=False, exist_ok=False):  # what a read-only or forbidden folder answers
        if self.name == "deeper":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, mode, parents, exist_ok)

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(UserError, match=r"cannot be made: permission denied \(.*/new/deeper\); nothing was changed"):
        storage.make_directory(tmp_path / "new" / "deeper", "--out")
    assert not (tmp_path / "new").exists()  # made on the way, removed again
