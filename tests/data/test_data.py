"""Tests for finetune.data: reading, validation, exact label masks, truncation, split, packing, collate.

Expected values are computed here from the tokenizer and the chat template directly (not
from finetune.data), e.g. the end-of-turn text is found by rendering a sentinel reply.
"""

import csv
import json
import logging
import re
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from finetune.data.build import build_datasets
from finetune.data.collate import collate
from finetune.data.formats import TABLE, detect_format
from finetune.data.read import DataError, read_rows

IGNORE = -100


# ------------------------------------------------------------------ fixtures and helpers


@pytest.fixture(scope="module")
def eot(tokenizer):
    """The template's end-of-turn text after an assistant reply (e.g. '<|im_end|>\\n')."""
    full = render(tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "SENTINEL"}])
    return full.split("SENTINEL", 1)[1]


def make_cfg(path, **overrides):
    cfg = dict(
        path=str(path),
        format="auto",
        split="train",
        max_length=512,
        eval_fraction=0.0,
        train_on_prompt=False,
        system_prompt=None,
        chat_template=True,
        packing=False,
        on_bad_rows="error",
        max_samples=None,
    )
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json_array(path, rows):
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return path


def write_csv(path, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def render(tokenizer, messages, generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def trained_runs(tokenizer, input_ids, labels):
    """Decode each maximal run of consecutive trained positions."""
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE:
            assert label == token, "a trained label must equal its input token"
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def chat(user, assistant, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def build(tokenizer, path, seed=0, **overrides):
    return build_datasets(make_cfg(path, **overrides), tokenizer, seed=seed)


def n_tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------ formats and label masks


ALPACA_ROWS = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
]


@pytest.mark.parametrize("writer, suffix", [(write_jsonl, ".jsonl"), (write_csv, ".csv")])
def test_alpaca_trains_only_the_response_and_end_of_turn(tokenizer, eot, tmp_path, writer, suffix):
    path = writer(tmp_path / f"train{suffix}", ALPACA_ROWS)
    bundle = build(tokenizer, path)

    assert bundle.stats.format == "alpaca"
    assert len(bundle.train) == 2
    expected_users = ["Name a colour.", "Add the numbers.\n\n2 and 3"]
    for example, row, user in zip(bundle.train, ALPACA_ROWS, expected_users):
        assert tokenizer.decode(example["input_ids"]) == render(tokenizer, chat(user, row["output"]))
        assert trained_runs(tokenizer, example["input_ids"], example["labels"]) == [row["output"] + eot]
        prompt_len = n_tokens(tokenizer, render(tokenizer, chat(user, row["output"])[:1], generation_prompt=True))
        assert all(label == IGNORE for label in example["labels"][:prompt_len])


def test_prompt_completion_from_json_array(tokenizer, eot, tmp_path):
    rows = [{"prompt": "Capital of France?", "completion": "Paris."}, {"prompt": "2+2?", "completion": "4"}]
    bundle = build(tokenizer, write_json_array(tmp_path / "train.json", rows))

    assert bundle.stats.format == "prompt_completion"
    for example, row in zip(bundle.train, rows):
        assert tokenizer.decode(example["input_ids"]) == render(tokenizer, chat(row["prompt"], row["completion"]))
        assert trained_runs(tokenizer, example["input_ids"], example["labels"]) == [row["completion"] + eot]


def test_messages_single_turn_from_jsonl(tokenizer, eot, tmp_path):
    messages = chat("Hello, who are you?", "I am a test assistant.")
    bundle = build(tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]))

    example = bundle.train[0]
    assert bundle.stats.format == "messages"
    assert tokenizer.decode(example["input_ids"]) == render(tokenizer, messages)
    assert trained_runs(tokenizer, example["input_ids"], example["labels"]) == ["I am a test assistant." + eot]


def test_messages_multi_turn_with_system_from_parquet(tokenizer, eot, tmp_path):
    messages = [
        {"role": "system", "content": "You answer tersely."},
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "Second answer."},
    ]
    bundle = build(tokenizer, write_parquet(tmp_path / "m.parquet", [{"messages": messages}]))

    example = bundle.train[0]
    full = render(tokenizer, messages)
    assert tokenizer.decode(example["input_ids"]) == full
    assert "You answer tersely." in full
    runs = trained_runs(tokenizer, example["input_ids"], example["labels"])
    assert runs == ["First answer." + eot, "Second answer." + eot]
    untrained = tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label == IGNORE])
    for text in ("You answer tersely.", "First question?", "Second question?"):
        assert text in untrained


def test_sharegpt_maps_roles_and_trains_gpt_turns(tokenizer, eot, tmp_path):
    conversation = [
        {"from": "system", "value": "Be kind."},
        {"from": "human", "value": "Hi!"},
        {"from": "gpt", "value": "Hello there."},
        {"from": "user", "value": "Bye."},
        {"from": "assistant", "value": "Goodbye."},
    ]
    # A .json file holding JSON lines (not an array) is accepted too.
    path = tmp_path / "share.json"
    path.write_text(json.dumps({"conversations": conversation}) + "\n", encoding="utf-8")
    bundle = build(tokenizer, path)

    expected_messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Bye."},
        {"role": "assistant", "content": "Goodbye."},
    ]
    example = bundle.train[0]
    assert bundle.stats.format == "sharegpt"
    assert tokenizer.decode(example["input_ids"]) == render(tokenizer, expected_messages)
    assert trained_runs(tokenizer, example["input_ids"], example["labels"]) == ["Hello there." + eot, "Goodbye." + eot]


def test_text_format_trains_every_token_and_appends_eos(tokenizer, tmp_path):
    rows = [{"text": "The quick brown fox."}, {"text": "Jumps over the lazy dog."}]
    bundle = build(tokenizer, write_parquet(tmp_path / "t.parquet", rows))

    assert bundle.stats.format == "text"
    for example, row in zip(bundle.train, rows):
        expected_ids = tokenizer(row["text"] + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        assert example["input_ids"] == expected_ids
        assert example["labels"] == expected_ids


def test_text_format_from_csv(tokenizer, tmp_path):
    bundle = build(tokenizer, write_csv(tmp_path / "t.csv", [{"text": 'a, b and "c"'}]))
    assert tokenizer.decode(bundle.train[0]["labels"]) == 'a, b and "c"' + tokenizer.eos_token


def test_system_prompt_added_only_when_row_has_none(tokenizer, eot, tmp_path):
    own = chat("Q1", "A1", system="Row system.")
    rows = [{"messages": chat("Q0", "A0")}, {"messages": own}]
    bundle = build(tokenizer, write_jsonl(tmp_path / "m.jsonl", rows), system_prompt="Config system.")

    first, second = bundle.train
    assert tokenizer.decode(first["input_ids"]) == render(tokenizer, chat("Q0", "A0", system="Config system."))
    assert tokenizer.decode(second["input_ids"]) == render(tokenizer, own)
    assert trained_runs(tokenizer, first["input_ids"], first["labels"]) == ["A0" + eot]


def test_train_on_prompt_trains_every_token(tokenizer, tmp_path):
    messages = [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": "Three?"},
        {"role": "assistant", "content": "Four."},
    ]
    bundle = build(tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]), train_on_prompt=True)

    example = bundle.train[0]
    expected_ids = tokenizer(render(tokenizer, messages), add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == expected_ids
    assert example["labels"] == expected_ids


def test_plain_concatenation_when_chat_template_is_off(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    bundle = build(tokenizer, path, chat_template=False)

    eos = tokenizer.eos_token
    prompts = ["Name a colour.", "Add the numbers.\n\n2 and 3"]
    for example, row, prompt in zip(bundle.train, ALPACA_ROWS, prompts):
        assert tokenizer.decode(example["input_ids"]) == prompt + row["output"] + eos
        assert trained_runs(tokenizer, example["input_ids"], example["labels"]) == [row["output"] + eos]
        assert example["input_ids"][-1] == tokenizer.eos_token_id


def test_missing_chat_template_names_tokenizer_and_fix(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    path = write_jsonl(tmp_path / "a.jsonl", ALPACA_ROWS)
    with pytest.raises(DataError) as info:
        build(tokenizer, path)
    assert tokenizer.name_or_path in str(info.value)
    assert "chat_template: false" in str(info.value)
    # The suggested fix works.
    assert len(build(tokenizer, path, chat_template=False).train) == 2


def test_template_that_is_not_prefix_stable_is_rejected(tokenizer, tmp_path, monkeypatch):
    # Starts with the message count, so a rendered prefix is never a prefix of the full text.
    template = (
        "{{ messages|length }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    monkeypatch.setattr(tokenizer, "chat_template", template)
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat("q", "a")}])
    with pytest.raises(DataError, match="prefix-stable") as info:
        build(tokenizer, path)
    assert "train_on_prompt" in str(info.value) and "m.jsonl row 1" in str(info.value)
    assert len(build(tokenizer, path, train_on_prompt=True).train) == 1


# ------------------------------------------------------------------ format detection


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"messages": [], "text": "x"}, "messages"),
        ({"conversations": []}, "sharegpt"),
        ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        ({"text": "t", "meta": 1}, "text"),
    ],
)
def test_detect_format_auto(row, expected):
    assert detect_format([row]) == expected


def test_detect_format_declared_is_returned_as_is():
    assert detect_format([{"whatever": 1}], "text") == "text"
    assert set(TABLE) == {"alpaca", "prompt_completion", "messages", "sharegpt", "text"}


def test_detect_format_unknown_keys_lists_found_and_needed_keys():
    with pytest.raises(DataError) as info:
        detect_format([{"question": "q", "answer": "a"}], path="d.jsonl")
    message = str(info.value)
    assert "d.jsonl" in message and "'answer'" in message and "'question'" in message
    for needed in ("instruction", "output", "prompt", "completion", "messages", "conversations", "text"):
        assert needed in message


# ------------------------------------------------------------------ bad input


def test_malformed_json_line_reports_file_and_row(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n', encoding="utf-8")
    for call in (lambda: read_rows(str(path)), lambda: build(tokenizer, path)):
        with pytest.raises(DataError) as info:
            call()
        assert "train.jsonl row 3" in str(info.value) and "malformed JSON" in str(info.value)
        assert info.value.row == 3


def test_blank_lines_do_not_shift_row_numbers(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "a"}\n\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"row 3: expected a JSON object, got list"):
        read_rows(str(path))


def test_json_array_element_not_an_object(tmp_path):
    path = write_json_array(tmp_path / "a.json", [{"text": "a"}, "just a string"])
    with pytest.raises(DataError, match=r"a\.json row 2: expected a JSON object, got string"):
        read_rows(str(path))


def test_missing_key_names_row_key_and_needed_keys(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [ALPACA_ROWS[0], {"instruction": "No output here"}])
    with pytest.raises(DataError) as info:
        build(tokenizer, path)
    message = str(info.value)
    assert "train.jsonl row 2" in message and "missing key 'output'" in message
    assert "instruction, output" in message


@pytest.mark.parametrize(
    "bad_row, fmt, expected",
    [
        ({"instruction": "i", "output": 5}, "alpaca", "'output' must be a string, got number"),
        ({"instruction": "", "output": "o"}, "alpaca", "'instruction' is empty"),
        ({"instruction": "i", "input": ["x"], "output": "o"}, "alpaca", "'input' must be a string, got list"),
        ({"prompt": "p", "completion": None}, "prompt_completion", "'completion' is null (prompt_completion rows"),
        ({"prompt": "p"}, "prompt_completion", "missing key 'completion' (prompt_completion rows"),
        ({"instruction": None, "output": "o"}, "alpaca", "'instruction' is null"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
            "messages",
            "messages[1].content is null",
        ),
        ({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]}, "messages", "messages[1] is missing key"),
        ({"messages": "hello"}, "messages", "'messages' must be a list"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 3}]},
            "messages",
            "messages[1].content must be a string, got number",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
            "messages",
            "messages[1].role must be one of",
        ),
        ({"messages": [{"role": "user", "content": "q"}]}, "messages", "no assistant turn"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]},
            "sharegpt",
            "conversations[1].from must be one of",
        ),
        ({"text": 12}, "text", "'text' must be a string, got number"),
    ],
)
def test_wrong_types_are_errors_not_coerced(tokenizer, tmp_path, bad_row, fmt, expected):
    good = {
        "alpaca": ALPACA_ROWS[0],
        "prompt_completion": {"prompt": "p", "completion": "c"},
        "messages": {"messages": chat("q", "a")},
        "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        "text": {"text": "t"},
    }[fmt]
    path = write_jsonl(tmp_path / "data.jsonl", [good, bad_row])
    with pytest.raises(DataError) as info:
        build(tokenizer, path)
    assert "data.jsonl row 2" in str(info.value)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "name, content, what",
    [
        ("e.jsonl", b"", "file is empty"),
        ("e.json", b"  \n", r"file is empty \(3 bytes of blank space\)"),
        ("e.jsonl", b"\n\r\n\n", r"file is empty \(4 bytes of blank space\)"),
        ("e.csv", b"", "file is empty"),
        ("e.parquet", b"", "file is empty"),
    ],
)
def test_empty_file(tmp_path, name, content, what):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"{name}: {what}"):
        read_rows(str(path))


def test_non_utf8_jsonl_names_row_and_byte_offset(tmp_path):
    data = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        read_rows(str(path))
    message = str(info.value)
    assert "latin1.jsonl row 2" in message and "UTF-8" in message
    offset = data.index(b"\xe9")
    assert f"byte offset {offset}" in message


def test_non_utf8_csv_names_row_and_byte_offset(tmp_path):
    data = b"text\nfine\ncaf\xe9\n"
    path = tmp_path / "latin1.csv"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        read_rows(str(path))
    assert "latin1.csv row 2" in str(info.value)
    offset = data.index(b"\xe9")
    assert f"byte offset {offset}" in str(info.value)


def test_missing_file_and_unsupported_extension(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        read_rows(str(tmp_path / "nope.jsonl"))
    path = tmp_path / "notes.txt"
    path.write_text("hello", encoding="utf-8")
    with pytest.raises(DataError, match=r"notes\.txt: unsupported file extension '\.txt'"):
        read_rows(str(path))


def test_hub_name_is_loaded_with_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([{"text": "from the hub"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert read_rows("some-org/some-dataset", split="validation") == [{"text": "from the hub"}]
    assert calls == [("some-org/some-dataset", "validation")]


def test_skip_bad_rows_records_exact_row_numbers(tokenizer, tmp_path, caplog):
    lines = [json.dumps({"text": f"good row {i}"}) for i in range(1, 11)]
    lines[2] = '{"text": '  # row 3: malformed JSON
    lines[5] = json.dumps({"txt": "typo"})  # row 6: missing key
    lines[8] = json.dumps({"text": 42})  # row 9: wrong type
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        bundle = build(tokenizer, path, on_bad_rows="skip", eval_fraction=0.3)

    assert [row for row, _ in bundle.stats.rows_skipped] == [3, 6, 9]
    assert "missing key 'text'" in bundle.stats.rows_skipped[1][1]
    assert bundle.stats.rows_read == 10
    assert len(bundle.train) + len(bundle.eval) == 7
    assert bundle.stats.train_examples + bundle.stats.eval_examples == 7
    assert any("skipped 3 bad row(s)" in r.getMessage() and "row 3" in r.getMessage() for r in caplog.records)


def test_skip_still_raises_when_every_row_is_bad(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": 1}, {"text": None}])
    with pytest.raises(DataError, match=r"bad\.jsonl: all 2 row\(s\) are bad"):
        build(tokenizer, path, on_bad_rows="skip")


def test_max_samples_takes_the_first_valid_rows(tokenizer, tmp_path):
    rows = [{"text": "r1"}, {"text": 5}, {"text": "r3"}, {"text": "r4"}, {"text": "r5"}]
    bundle = build(tokenizer, write_jsonl(tmp_path / "d.jsonl", rows), max_samples=3, on_bad_rows="skip")
    decoded = [tokenizer.decode(ex["input_ids"]) for ex in bundle.train]
    assert decoded == [f"r{i}{tokenizer.eos_token}" for i in (1, 3, 4)]


# ------------------------------------------------------------------ truncation and split


def test_truncation_is_counted_and_label_less_examples_dropped(tokenizer, tmp_path, caplog):
    max_length = 40
    rows = [
        {"instruction": "word " * 60, "output": "never reached"},  # prompt alone exceeds max_length
        {"instruction": "Tell a story.", "output": "Once upon a time " * 20},  # cut inside the response
        {"instruction": "Hi", "output": "Hello."},  # fits
    ]
    full_lengths = [n_tokens(tokenizer, render(tokenizer, chat(r["instruction"], r["output"]))) for r in rows]
    prompt_lengths = [
        n_tokens(tokenizer, render(tokenizer, chat(r["instruction"], r["output"])[:1], generation_prompt=True))
        for r in rows
    ]
    expected_truncated = sum(n > max_length for n in full_lengths)
    expected_dropped = sum(p >= max_length for p in prompt_lengths)
    assert (expected_truncated, expected_dropped) == (2, 1)  # the rows above are built for this

    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="finetune.data"):
        bundle = build(tokenizer, path, max_length=max_length)
    untruncated = build(tokenizer, path, max_length=10_000)

    assert bundle.stats.truncated == expected_truncated
    assert bundle.stats.dropped_no_labels == expected_dropped
    assert bundle.stats.train_examples == len(bundle.train) == 2
    assert [len(ex["input_ids"]) for ex in bundle.train] == [max_length, full_lengths[2]]
    assert bundle.train[0]["labels"] == untruncated.train[1]["labels"][:max_length]
    assert any("longer than max_length" in r.getMessage() for r in caplog.records)


def test_eval_split_is_deterministic_disjoint_and_sized(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"example number {i}"} for i in range(20)])

    def split(seed):
        bundle = build(tokenizer, path, seed=seed, eval_fraction=0.25)

        def texts(ds):
            return {tokenizer.decode(ex["input_ids"]) for ex in ds}

        return texts(bundle.train), texts(bundle.eval), bundle.stats

    train, eval_, stats = split(seed=3)
    assert (len(train), len(eval_)) == (15, 5)
    assert (stats.train_examples, stats.eval_examples) == (15, 5)
    assert not train & eval_
    assert train | eval_ == {f"example number {i}{tokenizer.eos_token}" for i in range(20)}
    assert split(seed=3)[:2] == (train, eval_)
    assert split(seed=4)[1] != eval_


def test_no_eval_set_when_fraction_is_zero(tokenizer, tmp_path):
    bundle = build(tokenizer, write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}]))
    assert bundle.eval is None and bundle.stats.eval_examples == 0


# ------------------------------------------------------------------ packing


def split_packed_row(row):
    """Cut a packed row back into examples at every position_ids reset."""
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    return [(row["input_ids"][a:b], row["labels"][a:b], row["position_ids"][a:b]) for a, b in zip(starts, starts[1:])]


def test_packing_fits_rows_restarts_positions_and_masks_boundaries(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "short text " * (1 + i % 7)} for i in range(30)])
    max_length = 64
    unpacked = build(tokenizer, path, max_length=max_length)
    packed = build(tokenizer, path, max_length=max_length, packing=True)

    assert packed.stats.packed and not unpacked.stats.packed
    assert set(packed.train.column_names) == {"input_ids", "labels", "position_ids"}
    assert len(packed.train) < len(unpacked.train)
    assert all(len(row["input_ids"]) <= max_length for row in packed.train)

    pieces = [piece for row in packed.train for piece in split_packed_row(row)]
    originals = {tuple(ex["input_ids"]): ex["labels"] for ex in unpacked.train}
    assert sorted(tuple(ids) for ids, _, _ in pieces) == sorted(tuple(ex["input_ids"]) for ex in unpacked.train)
    for row in packed.train:
        for k, (ids, labels, positions) in enumerate(split_packed_row(row)):
            assert positions == list(range(len(ids)))
            expected = list(originals[tuple(ids)])
            if k > 0:
                expected[0] = IGNORE  # would be predicted from the previous example's last token
            assert labels == expected

    # Text rows train every token, so each example after the first in a row loses one label.
    unpacked_trained = sum(sum(label != IGNORE for label in ex["labels"]) for ex in unpacked.train)
    boundaries = len(unpacked.train) - len(packed.train)
    packed_trained = sum(sum(label != IGNORE for label in row["labels"]) for row in packed.train)
    assert packed_trained == unpacked_trained - boundaries
    # trained tokens are what the shifted loss scores: label 0 of a row never is, so each row gives
    # up its first label too, and packed and unpacked layouts count the same (issue 15 item 8)
    assert packed.stats.train_trained_tokens == packed_trained - len(packed.train)
    assert (
        packed.stats.train_trained_tokens
        == unpacked.stats.train_trained_tokens
        == unpacked_trained - len(unpacked.train)
    )
    assert packed.stats.train_input_tokens == unpacked.stats.train_input_tokens


def test_eval_set_is_never_packed(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": f"row {i}"} for i in range(10)])
    bundle = build(tokenizer, path, packing=True, eval_fraction=0.2)
    assert bundle.eval.column_names == ["input_ids", "labels"]
    assert len(bundle.eval) == 2


def test_packed_sequences_do_not_attend_to_each_other(tokenizer, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = [{"text": "Alpha beta gamma delta epsilon."}, {"text": "Completely different second example here"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    packed_row = build(tokenizer, path, max_length=256, packing=True).train[0]
    first, second = split_packed_row(packed_row)
    b_ids = second[0]

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()

    # Batch of two packed rows: A+B, and B alone (shorter, so collate pads it).
    alone_row = {"input_ids": b_ids, "labels": b_ids, "position_ids": list(range(len(b_ids)))}
    batch = collate([packed_row, alone_row], pad_token_id=tokenizer.pad_token_id)
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        reference = model(input_ids=torch.tensor([b_ids]), use_cache=False).logits[0]
        leaky = model(input_ids=batch["input_ids"][:1], use_cache=False).logits[0]

    offset = len(first[0])
    b_in_pack = packed_logits[0, offset : offset + len(b_ids)]
    torch.testing.assert_close(b_in_pack, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_logits[1, : len(b_ids)], reference, atol=1e-5, rtol=0)
    # Control: with plain causal attention over the row, B does see A and its logits change.
    assert (leaky[offset : offset + len(b_ids)] - reference).abs().max() > 1e-3


# ------------------------------------------------------------------ collate


def test_collate_pads_unpacked_batch_with_attention_mask():
    features = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate(features, pad_token_id=0)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


def test_collate_packed_batch_continues_positions_into_padding():
    features = [
        {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, IGNORE, 4, 5], "position_ids": [0, 1, 0, 1, 2]},
        {"input_ids": [6, 7], "labels": [6, 7], "position_ids": [0, 1]},
    ]
    batch = collate(features, pad_token_id=9)
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 9, 9, 9]]
    assert batch["labels"].tolist() == [[1, 2, IGNORE, 4, 5], [6, 7, IGNORE, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2]]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_stop_ends_the_preparation_and_its_processes_early(tokenizer, tmp_path, caplog, processes):
    """`interrupt()` (finetune/training/signals.py Stops.check_interrupt raises once a stop signal arrived) is
    checked ten times a second while the data is prepared; once it raises, the map's processes stop at
    their next rows, nothing is kept and the stop is raised. Before, with a row-by-row loop in one
    process, the check was per row (a SIGTERM during the build of 60,000 rows once took 124-144 s)."""
    path = write_jsonl(
        tmp_path / "rows.jsonl", [{"instruction": f"Add {i} and 1.", "output": str(i + 1)} for i in range(30_000)]
    )
    calls = []

    class Stop(Exception):
        pass

    def interrupt():
        calls.append(1)
        if len(calls) == 10:  # a signal arrived about a second into the preparation
            raise Stop

    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="finetune.data.prepare"), pytest.raises(Stop):
        build_datasets(make_cfg(path, cache_dir=str(cache), num_proc=processes), tokenizer, seed=0, interrupt=interrupt)
    stopped = re.search(r"data preparation stopped after (\d+) of 30000 rows", caplog.text)
    assert stopped and int(stopped.group(1)) < 30_000, caplog.text
    assert list(cache.iterdir()) == []  # nothing half-prepared is left
