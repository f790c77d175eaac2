"""Data as people keep it (issue 46): globs and folders of shards in every format, the Hub's split naming, and each
malformed file or row named with its file, row and actual cause, every problem of the first pass in one message.
Preflight (check_head) and the run's reader (read_rows, build_datasets) are both checked: they must agree.
Before: a glob was "file not found", a folder "is a directory, not a data file", a key given twice trained the last
value silently, and the causes below were "malformed JSON" or no word at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.config.sections import DataConfig
from finetune.data.build import build_datasets, check_head
from finetune.data.read import DataError, read_rows

ROWS = [{"instruction": f"Add {i} and {i}.", "output": str(2 * i)} for i in range(6)]
MESSAGES = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}


def cfg(path, **overrides) -> DataConfig:
    return DataConfig(**({"path": str(path), "max_length": 256} | overrides))


def jsonl(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def both(path, **overrides) -> tuple[list[str], object]:
    """(preflight's problems, the run's rows or its DataError)."""
    try:
        rows = read_rows(str(path), split=overrides.get("split", "train"))
    except DataError as e:
        rows = e
    return check_head(cfg(path, **overrides)), rows


def write_shards(folder: Path, kind: str, names: list[str], parts: list[list[dict]]) -> None:
    """Each part of the rows as one file of `kind` in `folder`."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in zip(names, parts):
        path = folder / name
        if kind == "jsonl":
            path.write_text(jsonl(rows))
        elif kind == "json":
            path.write_text(json.dumps(rows, indent=1))
        elif kind == "csv":
            path.write_text("instruction,output\n" + "".join(f"{r['instruction']},{r['output']}\n" for r in rows))
        elif kind == "parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        else:  # an Arrow stream file as datasets writes them (save_to_disk's data-00000-of-00001.arrow)
            saved = folder / f".{name}.d"
            datasets.Dataset.from_list(rows).save_to_disk(str(saved))
            next(saved.glob("*.arrow")).rename(path)


# --- read as they are -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "arrow"])
def test_a_folder_and_a_glob_of_shards_are_read_in_name_order(tmp_path, kind):
    folder = tmp_path / "shards"
    write_shards(folder, kind, [f"part-{i}.{kind}" for i in (2, 0, 1)], [ROWS[4:], ROWS[:2], ROWS[2:4]])
    (folder / "README.md").write_text("# my data\n")  # a dataset card beside the shards: not data
    (folder / ".gitattributes").write_text("*.parquet filter=lfs\n")
    assert both(folder) == ([], ROWS)  # before: "is a directory, not a data file"
    assert both(folder / f"*.{kind}") == ([], ROWS)  # before: "file not found"
    assert both(tmp_path / "**" / f"part-*.{kind}") == ([], ROWS)


def test_the_hubs_shard_names_give_the_split_and_a_missing_shard_is_named(tmp_path):
    folder = tmp_path / "hub-dataset"
    names = ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet", "test-00000-of-00001.parquet"]
    write_shards(folder / "data", "parquet", names, [ROWS[:3], ROWS[3:5], ROWS[5:]])
    (folder / "README.md").write_text("---\nconfigs: ...\n---\n")
    assert both(folder) == ([], ROWS[:5])
    assert both(folder, split="test") == ([], ROWS[5:])
    problems, rows = both(folder, split="validation")
    assert problems == [
        f"data.path: {folder}: the folder: the splits test, train, none of them data.split 'validation'"
    ], problems
    (folder / "data" / names[1]).unlink()  # a download cut short
    problems, rows = both(folder)
    said = "1 of the 2 'train' shards are missing (train-00001-of-00002); copy or download them again"
    assert said in problems[0] and said in str(rows), (problems, rows)


def test_a_folder_of_two_formats_is_refused_not_read_twice(tmp_path):
    folder = tmp_path / "data"
    write_shards(folder, "jsonl", ["rows.jsonl"], [ROWS])
    write_shards(folder, "csv", ["rows.csv"], [ROWS])  # the same rows, exported twice
    problems, rows = both(folder)
    said = "the folder: data files of several formats (.csv: 1, .jsonl: 1)"
    assert said in problems[0] and said in str(rows), (problems, rows)


def test_a_glob_that_matches_nothing_says_what_its_folder_holds(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.jsonl").write_text(jsonl(ROWS))
    problems, rows = both(tmp_path / "shards" / "*.json")
    assert problems == [
        f"data.path: {tmp_path}/shards/*.json: no file matches this pattern (its folder {tmp_path}/shards holds a.jsonl)"
    ]
    assert isinstance(rows, DataError)


def test_a_glob_under_a_folder_named_with_glob_characters_reads_that_folder(tmp_path):
    """Before: `run[1]/*.jsonl` looked in `run1/` (a character class) and found nothing, without naming the folder."""
    folder = tmp_path / "exports [1] *new*"
    write_shards(folder, "jsonl", ["a.jsonl", "b.jsonl"], [ROWS[:3], ROWS[3:]])
    assert both(folder / "*.jsonl") == ([], ROWS)
    problems, rows = both(folder / "*.json")
    assert problems == [
        f"data.path: {folder}/*.json: no file matches this pattern (its folder {folder} holds a.jsonl, b.jsonl)"
    ]
    assert isinstance(rows, DataError)


@pytest.mark.parametrize("kind", ["dangling link", "named pipe"])
def test_a_glob_names_a_shard_it_cannot_read_as_a_folder_does(tmp_path, kind):
    """Before: the glob left such a shard out without a word and trained on the others; the folder named it."""
    import os

    folder = tmp_path / "shards"
    write_shards(folder, "jsonl", ["a.jsonl", "c.jsonl"], [ROWS[:3], ROWS[3:]])
    if kind == "dangling link":
        (folder / "b.jsonl").symlink_to(tmp_path / "moved-away.jsonl")
    else:
        os.mkfifo(folder / "b.jsonl")
    for path in (folder, folder / "*.jsonl"):
        problems, rows = both(path)
        assert len(problems) == 1 and f"{folder}/b.jsonl: is a " in problems[0], problems
        assert kind.split()[-1] in problems[0] and kind.split()[-1] in str(rows), (problems, rows)


def test_a_bad_row_of_a_shard_is_named_by_its_file_and_row_in_the_run_too(tmp_path, tokenizer):
    folder = tmp_path / "shards"
    bad = dict(ROWS[3], output=7)
    write_shards(folder, "jsonl", ["a.jsonl", "b.jsonl"], [ROWS[:2], [ROWS[2], bad]])
    said = f"{folder}/b.jsonl row 2: 'output' must be a string, got number 7"
    assert check_head(cfg(folder)) == [f"data.path: {said}"]
    with pytest.raises(DataError) as error:
        build_datasets(cfg(folder, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    assert str(error.value) == said
    bundle = build_datasets(cfg(folder, cache_dir=str(tmp_path / "cache"), on_bad_rows="skip"), tokenizer, seed=0)
    assert bundle.stats.train_examples == 3 and bundle.stats.rows_skipped == [(4, said.split(": ", 1)[1])]
    assert bundle.stats.files == [(f"{folder}/a.jsonl", 2), (f"{folder}/b.jsonl", 2)]  # row 4 = b.jsonl row 2


# --- malformed files and rows, named by their cause ---------------------------------------------------


CAUSES = [
    # (file name, bytes, where, what the message says)
    (
        "dup.jsonl",
        (jsonl(ROWS[:1]) + '{"instruction": "Add 1 and 1.", "output": "2", "output": "3"}\n').encode(),
        "row 2",
        'the key \'output\' appears 2 times in one object (values "2" and "3")',
    ),
    (
        "dup-nested.jsonl",
        b'{"messages": [{"role": "user", "content": "a", "content": "b"}, {"role": "assistant", "content": "c"}]}\n',
        "row 1",
        "the key 'content' appears 2 times in one object",
    ),
    (
        "dup.json",
        b'[{"instruction": "Add 1 and 1.", "output": "2", "instruction": "Add 2 and 2."}]',
        "",
        "the key 'instruction' appears 2 times in one object",
    ),
    ("dup.csv", b"instruction,output,output\nAdd 1 and 1.,2,3\n", "", "the column(s) 'output' at columns 2, 3 appear"),
    ("utf16.jsonl", jsonl(ROWS).encode("utf-16-le"), "", "UTF-16 (or UTF-32) text without a byte-order mark"),
    ("cr.jsonl", jsonl(ROWS).replace("\n", "\r").encode(), "", "its lines end in CR only (classic Mac OS"),
    (
        "joined.jsonl",
        (jsonl(ROWS[:1]) + "\ufeff" + jsonl(ROWS[1:2])).encode(),
        "row 2",
        "byte-order mark in the middle",
    ),
    (
        "pretty.jsonl",
        (jsonl(ROWS[:1]) + json.dumps(ROWS[1], indent=2) + "\n").encode(),
        "row 2",
        "an object spread over several lines (pretty-printed JSON)",
    ),
    (
        "two-arrays.json",
        (json.dumps(ROWS[:2]) + "\n" + json.dumps(ROWS[2:])).encode(),
        "",
        "the JSON array ends before line 2 column 1 and more follows: the format changes mid-file",
    ),
    (
        "delimiter.csv",
        b"instruction,output\nAdd 1 and 1.,2\nAdd 2 and 2.;4\n",
        "row 2",
        "has 1 field(s), fewer than the header's 2 (instruction, output), and its fields hold ';': the delimiter changes",
    ),
    (
        "formats.jsonl",
        (jsonl(ROWS[:2]) + json.dumps(MESSAGES) + "\n").encode(),
        "row 3",
        "this row has the keys of messages rows (messages), not those of the alpaca rows before it: the format changes",
    ),
    (
        "nested.jsonl",
        jsonl([{"example": r} for r in ROWS]).encode(),
        "",
        "the rows are nested one level down: each holds a row of the alpaca format under the key 'example'",
    ),
    ("inner-list.json", json.dumps([ROWS]).encode(), "row 1", "got a list of 6 object(s): the rows are nested"),
]


@pytest.mark.parametrize("name,content,where,said", CAUSES, ids=[c[0] for c in CAUSES])
def test_a_malformed_file_or_row_is_named_with_its_cause(tmp_path, tokenizer, name, content, where, said):
    path = tmp_path / name
    path.write_bytes(content)
    problems = check_head(cfg(path))
    head = f"data.path: {path}{' ' + where if where else ''}: "
    assert any(p.startswith(head) and said in p for p in problems), problems
    with pytest.raises(DataError) as error:  # the run says the same, never a traceback, never a silent value
        build_datasets(cfg(path, cache_dir=str(tmp_path / "cache")), tokenizer, seed=0)
    assert said in str(error.value), str(error.value)


def test_every_problem_of_the_first_pass_is_in_one_message(tmp_path):
    """Three shards, three problems (a file in UTF-16, a key given twice, a bad row): preflight names all three, each
    with its file and row, where before it stopped at the first (and a glob was "file not found")."""
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text(jsonl(ROWS[:2]) + json.dumps(dict(ROWS[2], output=None)) + "\n")
    (folder / "b.jsonl").write_bytes(jsonl(ROWS[3:]).encode("utf-16"))
    (folder / "c.jsonl").write_text('{"instruction": "x", "output": "1", "output": "2"}\n' + jsonl(ROWS[:1]))
    problems = check_head(cfg(folder / "*.jsonl"))
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"data.path: {folder}/b.jsonl: is UTF-16"), problems
    assert problems[1].startswith(f"data.path: {folder}/a.jsonl row 3: 'output' is null"), problems
    assert problems[2].startswith(f"data.path: {folder}/c.jsonl row 1: the key 'output' appears 2 times"), problems
