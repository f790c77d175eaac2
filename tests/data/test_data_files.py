"""Data files as users have them (issue 23, category 7): what a careful reader accepts is read, and
what cannot be read is named (a loop, a pipe, a directory, a permission) instead of "file not found",
"malformed JSON" or a hang. Preflight's look (check_head) and the run's reader (read_rows) are both
checked: they must agree, or preflight drains what the run then cannot read.

Rows with nothing to train on, the eval split and the held-out file read the way evaluation reads it
(category 3 and 6) are here too: preflight and the data build read them.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import pytest

from finetune.config.sections import DataConfig
from finetune.data.build import build_datasets, check_head
from finetune.data.read import DataError, read_rows

ROWS = [{"instruction": "Add 2 and 3.", "output": "5"}, {"instruction": "Add 1 and 1.", "output": "2"}]


def cfg(path, **overrides) -> DataConfig:
    return DataConfig(**({"path": str(path), "max_length": 256} | overrides))


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def both(path) -> tuple[list[str], object]:
    """(preflight's problems, the run's rows or its DataError)."""
    try:
        rows = read_rows(str(path))
    except DataError as e:
        rows = e
    return check_head(cfg(path)), rows


# --- read as they are ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,content",
    [
        # on main: preflight read the first MiB only and called a first row over 1 MiB "malformed JSON"
        ("big-first-row.jsonl", jsonl([{"instruction": "x" * (1 << 20) + "?", "output": "5"}, ROWS[1]])),
        # on main: "row 1: malformed JSON", with no hint that it is an array
        ("array.jsonl", json.dumps(ROWS, indent=2).encode()),
        ("array-with-bom.jsonl", b"\xef\xbb\xbf" + json.dumps(ROWS, indent=2).encode()),
        ("one-line-array.jsonl", json.dumps(ROWS).encode()),
        # on main: "unsupported file extension '.gz'"; "not valid UTF-8: byte 0x8b"
        ("train.jsonl.gz", gzip.compress(jsonl(ROWS))),
        ("gzip-named-plainly.jsonl", gzip.compress(jsonl(ROWS))),
        ("train.json.bz2", bz2.compress(json.dumps(ROWS).encode())),
        ("train.csv.gz", gzip.compress(b"instruction,output\r\nAdd 2 and 3.,5\r\nAdd 1 and 1.,2\r\n")),
        # read on main too: kept read
        ("bom.jsonl", b"\xef\xbb\xbf" + jsonl(ROWS)),
        ("crlf.jsonl", jsonl(ROWS).replace(b"\n", b"\r\n")),
        ("trailing-blank-lines.jsonl", jsonl(ROWS) + b"\n  \n\n"),
        ("bom-crlf.csv", b"\xef\xbb\xbfinstruction,output\r\nAdd 2 and 3.,5\r\nAdd 1 and 1.,2\r\n"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_files_a_careful_reader_accepts_are_read_by_preflight_and_the_run(tmp_path, name, content):
    """The `read on main too` cases are guards; the others failed on main as their comments say."""
    path = tmp_path / name
    path.write_bytes(content)
    problems, rows = both(path)
    assert problems == []
    assert isinstance(rows, list) and [r["output"] for r in rows] == ["5", "2"], rows


def test_a_big_first_row_is_read_whole_and_a_bad_row_after_it_still_named(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(jsonl([{"instruction": "x" * (3 << 20), "output": "5"}, {"instruction": "no output"}]))
    assert check_head(cfg(path)) == [
        f"data.path: {path} row 2: missing key 'output' (alpaca rows need instruction, output; optional input)"
    ]


def test_a_broken_array_in_a_jsonl_file_says_it_looks_like_an_array(tmp_path):
    path = tmp_path / "broken-array.jsonl"
    path.write_text(json.dumps(ROWS, indent=2)[:-3])
    problems, rows = both(path)
    assert len(problems) == 1 and "starts like a JSON array ('[') but is not one: malformed JSON at line" in problems[0]
    assert isinstance(rows, DataError) and "starts like a JSON array" in str(rows)


# --- named, never hung on ---------------------------------------------------------------------------


def test_a_symbolic_link_loop_and_a_dangling_link_are_named(tmp_path):
    loop, other = tmp_path / "loop.jsonl", tmp_path / "other.jsonl"
    loop.symlink_to(other)
    other.symlink_to(loop)
    problems, rows = both(loop)
    assert problems == [
        f"data.path: {loop}: is a symbolic link loop ({loop} -> {other} -> {loop}); point the link at the data file"
    ]
    assert "symbolic link loop" in str(rows)  # on main: "file not found"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "moved-away.jsonl")
    problems, rows = both(dangling)
    assert "is a symbolic link to" in problems[0] and "moved-away.jsonl" in problems[0] and "dangling" in problems[0]
    good = tmp_path / "good.jsonl"  # control: a link to a file is read
    good.write_bytes(jsonl(ROWS))
    (tmp_path / "link.jsonl").symlink_to(good)
    assert both(tmp_path / "link.jsonl")[0] == []


def test_a_named_pipe_is_refused_without_opening_it(tmp_path):
    """On main preflight read the pipe (blocking until a writer came, then draining it) and the run
    blocked reopening it: a hang. Run in a thread so this test fails instead of hanging with it."""
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    found: list = []
    worker = threading.Thread(target=lambda: found.append(both(fifo)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # release the blocked reader, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(timeout=10)
        pytest.fail("reading a named pipe blocked")
    problems, rows = found[0]
    assert problems == [
        f"data.path: {fifo}: is a named pipe (FIFO), not a regular file: it cannot be read twice (the check before "
        "training, then the run), and may never end; write the data to a file and give that path"
    ]
    assert "named pipe" in str(rows)


def test_a_device_given_as_the_data_file_is_named(tmp_path):
    link = tmp_path / "data.jsonl"
    link.symlink_to("/dev/null")  # on main: "file is empty"; /dev/zero would have been read forever
    problems, rows = both(link)
    assert "is a character device, not a regular file" in problems[0] and "character device" in str(rows)


def test_a_folder_without_data_files_is_named_with_what_it_holds(tmp_path):
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    (folder / "model.bin").write_bytes(b"x")
    problems, rows = both(folder)
    # before issue 46 a folder was refused whatever it held ("give the path of one file"); its data files are read now
    said = f"{folder}: the folder: no data file (.jsonl, .json, .csv, .parquet, .arrow, optionally .gz/.bz2/.xz)"
    assert problems == [f"data.path: {said}; it holds model.bin"], problems
    assert str(rows) == f"{said}; it holds model.bin"


def test_unreadable_compressions_are_named_with_the_unpacking_command(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 20)  # a zstd frame
    problems, rows = both(path)
    assert "is zstd-compressed, which is not read directly; unpack it (`zstd -d FILE`)" in problems[0]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(jsonl(ROWS) * 50)[:40])
    assert "is gzip-compressed but does not decompress" in both(cut)[0][0]


@contextlib.contextmanager
def as_another_user():
    """Root reads every file: as root, run the block with effective uid `nobody` (65534). Elsewhere
    the caller's chmod 000 denies it already."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_permission_denied_is_named_with_mode_and_owner(tmp_path):
    """On main: a PermissionError traceback from preflight."""
    folder = Path(tempfile.mkdtemp(prefix="perm-"))
    try:
        folder.chmod(0o755)
        path = folder / "train.jsonl"
        path.write_bytes(jsonl(ROWS))
        assert check_head(cfg(path)) == []  # control, and every module the check imports is loaded
        path.chmod(0o600 if os.geteuid() == 0 else 0o000)
        with as_another_user():
            problems, rows = both(path)
        assert len(problems) == 1 and problems[0].startswith(f"data.path: {path}: permission denied: mode -")
        assert "owner uid" in problems[0] and "chmod a+r" in problems[0] and "permission denied" in str(rows)
        hidden = tmp_path / "train.jsonl"  # pytest's tmp_path is 0700: not searchable by another user
        hidden.write_bytes(jsonl(ROWS))
        if os.geteuid() != 0:
            tmp_path.chmod(0o000)
        with as_another_user():
            problems, _ = both(hidden)
        tmp_path.chmod(0o700)
        assert problems == [
            f"data.path: {hidden}: permission denied: a directory on its path cannot be searched (its x bit is not "
            "set for you)"
        ]
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


def test_tilde_in_data_and_heldout_paths_is_expanded(tmp_path, monkeypatch):
    from finetune.config.recipe import load_recipe

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "train.jsonl").write_bytes(jsonl(ROWS))
    config, _ = load_recipe("demo", ["--data.path=~/train.jsonl", "--eval.heldout_path=~/train.jsonl"])
    assert config.data.path == str(tmp_path / "train.jsonl") == config.eval.heldout_path  # on main: '~/train.jsonl'
    assert check_head(config.data) == []


# --- what the run reads before training, read the way it reads it --------------------------------------


def test_rows_with_nothing_to_train_on_are_refused_above_the_share_and_named_below(tmp_path, tokenizer, caplog):
    """Category 6: on main every row with an empty output trained only the end-of-turn token, silently."""
    empty = [{"instruction": f"Say nothing {i}.", "output": ""} for i in range(3)]
    path = tmp_path / "empty.jsonl"
    path.write_bytes(jsonl(empty + ROWS[:1]))  # 3 of 4 rows empty: over the default share 0.5
    expected = "3 of 4 row(s) have nothing to train on: every target (output, completion, assistant turn) is empty"
    assert expected in check_head(cfg(path))[0] and "(row(s) 1, 2, 3)" in check_head(cfg(path))[0]
    with pytest.raises(DataError) as err:
        build_datasets(cfg(path), tokenizer, seed=0)
    assert expected in str(err.value) and "data.max_empty_target_share=0.5" in str(err.value)
    # at or below the share: trained, named in a warning and in run.json data.empty_target_rows
    with caplog.at_level(logging.WARNING):
        bundle = build_datasets(cfg(path, max_empty_target_share=0.75), tokenizer, seed=0)
    assert bundle.stats.empty_target_rows == [1, 2, 3] and "(row(s) 1, 2, 3)" in caplog.text
    # train_on_prompt trains the prompts: nothing to flag; a messages row with one empty assistant turn of two is fine
    assert build_datasets(cfg(path, train_on_prompt=True), tokenizer, seed=0).stats.empty_target_rows == []
    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]
    rows = [
        {"messages": talk},
        {"messages": [*talk, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
    ]
    mixed = tmp_path / "messages.jsonl"
    mixed.write_bytes(jsonl(rows))
    assert build_datasets(cfg(mixed, max_empty_target_share=0.5), tokenizer, seed=0).stats.empty_target_rows == [1]
    assert check_head(cfg(mixed, max_empty_target_share=0.4))[0].endswith(
        "that is more than data.max_empty_target_share=0.4 of the rows. Fill in the targets or drop those rows "
        "(or raise data.max_empty_target_share if they are meant to be empty)"
    )


def test_an_eval_split_that_leaves_nothing_to_train_on_is_found_by_preflight(tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_bytes(jsonl(ROWS))
    assert check_head(cfg(path, eval_fraction=0.75)) == [
        f"data.path: {path}: eval_fraction=0.75 of 2 usable example(s) leaves nothing to train on; lower "
        "data.eval_fraction or add rows"
    ]  # on main: found by the data build, after the run directory was made
    path.write_bytes(jsonl(ROWS * 4))
    assert check_head(cfg(path, eval_fraction=0.75)) == []  # control: 2 of 8 left to train on
    assert "eval_fraction=0.75 of 2 usable example(s)" in check_head(cfg(path, eval_fraction=0.75, max_samples=2))[0]


def test_preflight_reads_the_heldout_rows_as_the_evaluation_does(tmp_path):
    """Category 3: on main a held-out file in the wrong row format passed preflight and failed in
    the evaluation, after every step had run (with eval.before: false)."""
    from finetune import preflight
    from finetune.errors import ConfigError
    from finetune.launch import accelerate as launcher

    train = tmp_path / "train.jsonl"
    train.write_bytes(jsonl(ROWS * 4))
    held = tmp_path / "heldout.jsonl"
    held.write_bytes(jsonl([ROWS[0], {"messages": [{"role": "user", "content": "a"}]}]))
    args = [str(launcher.TRAIN_SCRIPT), "--recipe", "demo", f"--data.path={train}", "--eval.exact_match=true"]
    args += [f"--eval.heldout_path={held}", "--eval.before=false", f"--run.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as err:
        preflight.check_launch(args)
    assert err.value.problems == [
        f"eval.heldout_path: {held} row 2: exact-match rows need instruction/output or prompt/completion keys, "
        "found ['messages']"
    ]
    preflight.check_launch([*args, "--eval.samples=1"])  # control: the run evaluates only row 1, which is good
    assert not (tmp_path / "run").exists()


def test_tokenization_cache_entries_remember_the_empty_target_rows(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl([{"instruction": "a", "output": ""}, *ROWS, *ROWS]))
    settings = cfg(path, cache_tokenized=True, cache_dir=str(tmp_path / "cache"))
    first = build_datasets(settings, tokenizer, seed=0).stats.empty_target_rows
    assert first == [1] == build_datasets(settings, tokenizer, seed=0).stats.empty_target_rows  # from the cache
    assert len(list((tmp_path / "cache").iterdir())) == 1


# --- files read as users mean them ----------------------------------------------------------------


@pytest.mark.parametrize("indent", [None, 2])
def test_an_object_holding_one_list_of_rows_is_read_as_those_rows(tmp_path, caplog, indent):
    """On main: {"data": [...], "version": 2} on one line was ONE row with keys data and version
    ("cannot detect the data format"); pretty-printed, it was refused as "a single JSON object"."""
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"version": 2, "data": ROWS}, indent=indent))
    with caplog.at_level(logging.INFO, logger="finetune.data.read"):
        problems, rows = both(path)
    assert problems == [] and rows == ROWS
    assert "the rows are the list under the top-level key 'data' (2 rows)" in caplog.text
    path.write_text(json.dumps({"train": ROWS, "test": ROWS[:1]}, indent=indent))
    problems, rows = both(path)
    expected = f"{path}: is a single JSON object holding several lists (train, test); expected an array"
    assert problems[0].startswith(f"data.path: {expected}") and str(rows).startswith(expected)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    assert both(path)[1] == [json.loads(path.read_text())]  # control: a row of the messages format stays a row


def test_a_save_to_disk_folder_and_an_arrow_file_are_read(tmp_path):
    """On main: "is a directory, not a data file; give the path of one file" for the folder (its
    listing named the metadata files), and "unsupported file extension '.arrow'"."""
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert both(folder) == ([], ROWS)
    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(splits))
    assert both(splits) == ([], ROWS)
    assert read_rows(str(splits), split="test") == ROWS[:1]
    with pytest.raises(DataError, match=r"has no split 'validation'; its splits: train, test \(set data.split\)"):
        read_rows(str(splits), split="validation")
    (arrow,) = folder.glob("*.arrow")
    assert both(arrow) == ([], ROWS)


def test_special_tokens_typed_in_the_text_are_refused_with_the_row_and_the_fix(tmp_path, tokenizer):
    """On main: '<|im_start|>assistant' inside a user message became a real turn boundary, silently."""
    fake = "Hi<|im_start|>assistant\nsure<|im_end|>"
    rows = [
        {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]},
        {"messages": [{"role": "user", "content": fake}, {"role": "assistant", "content": "ok"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_bytes(jsonl(rows))
    with pytest.raises(DataError) as e:
        build_datasets(cfg(path), tokenizer, seed=0)
    assert str(e.value).startswith(
        f"{path} row 2: messages[0].content contains '<|im_start|>', a special token of tokenizer "
    )
    assert "Remove or rewrite it in the data" in str(e.value) and "data.on_bad_rows: skip" in str(e.value)
    skipped = build_datasets(cfg(path, on_bad_rows="skip"), tokenizer, seed=0)
    assert skipped.stats.train_examples == 1 and skipped.stats.rows_skipped[0][0] == 2
    path.write_bytes(jsonl([{"instruction": "Say <|endoftext|>", "output": "no"}]))
    with pytest.raises(DataError, match=r"row 1: 'instruction' contains '<\|endoftext\|>'"):
        build_datasets(cfg(path), tokenizer, seed=0)
    path.write_bytes(jsonl([{"instruction": "Say <|im_start |>", "output": "no"}]))  # control: not a token
    assert build_datasets(cfg(path), tokenizer, seed=0).stats.train_examples == 1
