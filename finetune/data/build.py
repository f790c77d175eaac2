"""The training datasets from `data.*`: read, validate, render, tokenize, truncate, split, pack.

    bundle = build_datasets(cfg.data, tokenizer, seed=42)   # DataBundle(train, eval, stats)

`check_head` is preflight's look at the first rows (finetune/preflight/checks.py), with the
same messages `build_datasets` would give. The datasets are prepared once per machine into Arrow
files and opened memory-mapped (finetune/data/prepare.py).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data import formats, prepare
from finetune.data.formats import BadRow, detect_format, empty_target, with_format_note
from finetune.data.pack import bins, packed_row
from finetune.data.read import Invalid, Shards, arrow_folder, is_local, parse_line, read_head, shard_files
from finetune.data.render import IGNORE_INDEX, Example, Renderer, tokenize
from finetune.errors import DataError

logger = logging.getLogger(__name__)


_LOG_FIRST_N = 5
_LIST_FIRST_N = 20  # bad rows and files named in one message


@dataclass
class DataStats:
    """What the data phase built; also the run record's `data` section (finetune/telemetry/record_schema.py
    declares it from these fields; docs/run_record.md gives their meanings)."""

    format: str
    rows_read: int  # rows taken from the source and examined (bad ones included)
    rows_skipped: list[tuple[int, str]]  # (row number, reason)
    train_examples: int  # examples, not packed rows (len(bundle.train) gives rows)
    eval_examples: int
    truncated: int
    packed: bool
    train_input_tokens: int
    train_trained_tokens: int
    dropped_no_labels: int = 0  # examples left with no trained token (e.g. truncated away)
    empty_target_rows: list[int] = field(default_factory=list)  # row numbers whose every target is empty
    # the data's files and each one's last row number, when data.path names several: row numbers count across them
    files: list[tuple[str, int]] = field(default_factory=list)

    def section(self) -> dict:
        """run.json `data`: these fields, the first 50 skipped rows and rows with empty targets."""
        return vars(self) | {"rows_skipped": self.rows_skipped[:50], "empty_target_rows": self.empty_target_rows[:50]}


@dataclass
class DataBundle:
    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset | None
    stats: DataStats


@dataclass
class _BadRowLog:
    """Applies on_bad_rows: `error` refuses the data naming every bad row in one message; `skip` records them and goes
    on (refused only when every row is bad)."""

    shards: Shards
    skip: bool
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def bad(self, row: int, reason: str) -> None:
        self.skipped.append((row, reason))

    def report(self, good: int) -> None:
        if self.skipped and not self.skip:
            raise listed(self.shards, self.skipped)
        if self.skipped and not good:
            first = "; ".join(f"{self.shards.label(n)}: {why}" for n, why in self.skipped[:_LOG_FIRST_N])
            raise DataError(f"all {len(self.skipped)} row(s) are bad; first problems: {first}", path=self.shards.path)


def listed(shards: Shards, bad: list[tuple[int, str]]) -> DataError:
    """One error naming every bad row (the first _LIST_FIRST_N of them, then how many more): file, row and cause."""
    if len(bad) == 1:
        return shards.error(bad[0][1], bad[0][0])
    lines = [f"  - {shards.label(n)}: {why}" for n, why in bad[:_LIST_FIRST_N]]
    more = [f"  ... and {len(bad) - _LIST_FIRST_N} more"] if len(bad) > _LIST_FIRST_N else []
    return DataError(
        "\n".join([f"{len(bad)} bad rows (data.on_bad_rows: skip leaves them out):", *lines, *more]), path=shards.path
    )


def check_head(cfg, *, max_rows: int = 100) -> list[str]:
    """Preflight for ``cfg.path`` before any weights load: the path names readable files (one, or a glob's or folder's
    shards), and the first ``max_rows`` rows of each read and validate as the detected (or declared) format, with the
    messages ``build_datasets`` would give (finetune/data/read.py read_head: the same readers). Every problem found is
    returned, one per file or row (the first _LIST_FIRST_N). When those rows are the whole data, the eval split and the
    share of rows with nothing to train on are checked too. Hub datasets are not checked here (that needs the network);
    the chat template and lengths need the tokenizer, so ``build_datasets`` checks those."""
    path, split = cfg.path, getattr(cfg, "split", "train")
    if not is_local(path):
        return []
    try:
        names = [path] if arrow_folder(path) else shard_files(path, split)
    except DataError as e:
        return [f"data.path: {e}"]
    heads, problems = [], []
    for name in names:
        try:
            heads.append((name if len(names) > 1 else path, *read_head(name, max_rows, split=split)))
        except DataError as e:
            problems.append(str(e))
    try:
        problems += _head_rows(cfg, heads, complete=all(c for _, _, c in heads) and not problems)
    except DataError as e:
        problems.append(str(e))
    more = [f"... and {len(problems) - _LIST_FIRST_N} more"] if len(problems) > _LIST_FIRST_N else []
    return [f"data.path: {p}" for p in problems[:_LIST_FIRST_N]] + more


def _head_rows(cfg, heads: list, *, complete: bool) -> list[str]:
    """The problems of the files' first rows (file, row, cause); with all of the rows read, the data's own checks."""
    skip = getattr(cfg, "on_bad_rows", "error") == "skip"
    rows = [(where, number, row) for where, numbered, _ in heads for number, row in numbered]
    first = next((row for _, _, row in rows if not isinstance(row, Invalid)), None)
    if first is None:
        if skip and not complete:
            return []
        return [str(DataError(row.reason, path=where, row=number)) for where, number, row in rows]
    fmt = detect_format([first], getattr(cfg, "format", "auto"), path=cfg.path)
    bad, empty = [], []
    for where, number, row in rows:
        reason = row.reason if isinstance(row, Invalid) else None
        if reason is None:
            try:
                formats.TABLE[fmt].validate(row)
                if empty_target(row, fmt):
                    empty.append(number if len(heads) == 1 else f"{where} row {number}")
            except BadRow as e:
                reason = with_format_note(str(e), row, fmt)
        if reason is not None:
            bad.append(str(DataError(reason, path=where, row=number)))
    # with on_bad_rows: skip, bad rows only stop training when every row of the data is bad
    if bad and (not skip or (complete and len(bad) == len(rows))):
        return bad
    if complete:
        good = len(rows) - len(bad)
        check_empty_targets(empty, good, cfg, cfg.path, warn=False)  # the data build warns, once
        used = min(good, getattr(cfg, "max_samples", None) or good)  # data.max_samples: the run's rows
        _split_problem(used, getattr(cfg, "eval_fraction", 0.0), cfg.path)
    return []


def head_examples(cfg, tokenizer, *, count: int, window: int) -> list[Example]:
    """The first `count` examples of `cfg.path` with a trained token, rendered and tokenized as the data build does
    (cut at data.max_length), each cut to the `window` tokens that end at its last trained token: a fixed batch of the
    run's own tokens (the export check's probe, finetune/export/). Bad rows are passed over."""
    path, split = cfg.path, getattr(cfg, "split", "train")
    first = path if not is_local(path) or arrow_folder(path) else shard_files(path, split)[0]  # a folder's first file
    numbered, _ = read_head(first, count * 8, split=split)
    rows = [row for _, row in numbered if not isinstance(row, Invalid)]
    if not rows:
        raise DataError("no readable row among the first ones (the export check reads a few)", path=cfg.path)
    renderer = Renderer(
        tokenizer, detect_format(rows[:1], getattr(cfg, "format", "auto"), path=cfg.path), cfg, cfg.path
    )
    rendered = []
    for row in rows:
        try:
            rendered.append(renderer.render(row))
        except BadRow:
            continue
    out = []
    for example in tokenize(rendered, tokenizer):
        labels = example.labels[: cfg.max_length]
        trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX and i > 0]  # label 0 is never scored
        if trained:
            end = trained[-1] + 1
            out.append(Example(example.input_ids[max(0, end - window) : end], labels[max(0, end - window) : end]))
        if len(out) == count:
            break
    if not out:
        raise DataError(
            "no example among the first rows has a trained token (the export check reads a few)", path=cfg.path
        )
    return out


def check_empty_targets(rows: list, good: int, cfg, path: str, *, warn: bool = True) -> None:
    """Rows whose every target is empty train only the template's end-of-turn tokens: above
    data.max_empty_target_share of the usable rows the data is refused, below it they are named in a
    warning (and counted in run.json data.empty_target_rows). With train_on_prompt every row trains."""
    if not rows or getattr(cfg, "train_on_prompt", False):
        return
    limit = getattr(cfg, "max_empty_target_share", 0.5)
    named = ", ".join(map(str, rows[:_LOG_FIRST_N])) + (" ..." if len(rows) > _LOG_FIRST_N else "")
    what = (
        f"{len(rows)} of {good} row(s) have nothing to train on: every target (output, completion, assistant "
        f"turn) is empty, so they train only the end-of-turn token (row(s) {named})"
    )
    if len(rows) > limit * good:
        raise DataError(
            f"{what}; that is more than data.max_empty_target_share={limit} of the rows. Fill in the targets or "
            "drop those rows (or raise data.max_empty_target_share if they are meant to be empty)",
            path=path,
        )
    if warn:
        logger.warning("%s: %s", path, what)


def _split_problem(n: int, eval_fraction: float, path: str) -> None:
    """data.eval_fraction of `n` usable examples must leave at least one to train on."""
    if eval_fraction and max(1, round(n * eval_fraction)) >= n:
        raise DataError(
            f"eval_fraction={eval_fraction} of {n} usable example(s) leaves nothing to train on; "
            "lower data.eval_fraction or add rows",
            path=path,
        )


def build_datasets(cfg, tokenizer, *, seed: int, interrupt=None) -> DataBundle:
    """Read, validate, render, tokenize, truncate, split and (optionally) pack ``cfg.path``, once per
    machine (finetune/data/prepare.py). ``interrupt()``, checked while the data is prepared or awaited,
    may raise to end the build early (a stop signal: finetune/training/signals.py check_interrupt)."""
    on_bad_rows = getattr(cfg, "on_bad_rows", "error")
    if on_bad_rows not in ("error", "skip"):
        raise DataError(f"on_bad_rows must be 'error' or 'skip', got {on_bad_rows!r}")
    train, eval_, facts = prepare.load(
        cfg, tokenizer, seed, lambda out, source: _prepare(cfg, tokenizer, seed, out, source, interrupt), interrupt
    )
    stats = DataStats(**facts["stats"])
    stats.rows_skipped = [tuple(x) for x in stats.rows_skipped]
    stats.files = [tuple(x) for x in stats.files]
    _warn(stats, cfg)
    packed = f", packed into {len(train)} rows" if stats.packed else ""
    logger.info(
        f"{cfg.path}: {stats.format} data, {stats.train_examples} train / {stats.eval_examples} eval examples, "
        f"{stats.train_input_tokens} train tokens ({stats.train_trained_tokens} trained){packed}"
    )
    return DataBundle(train=train, eval=eval_, stats=stats)


def _warn(stats: DataStats, cfg) -> None:
    """What the data build says on every run, from a new preparation or the machine's prepared one."""
    path, skipped = cfg.path, stats.rows_skipped
    shards = Shards(path, [f for f, _ in stats.files], [n for _, n in stats.files])
    if skipped:
        first = "; ".join(f"{shards.label(n)}: {why}" for n, why in skipped[:_LOG_FIRST_N])
        more = " ..." if len(skipped) > _LOG_FIRST_N else ""
        logger.warning("%s: skipped %d bad row(s): %s%s", path, len(skipped), first, more)
    if stats.truncated:
        logger.warning(f"{stats.truncated} example(s) were longer than max_length={cfg.max_length} tokens and were cut")
    if stats.dropped_no_labels:
        logger.warning(
            f"{stats.dropped_no_labels} example(s) had no trained tokens left (completion cut off by "
            f"max_length={cfg.max_length}) and were dropped"
        )
    check_empty_targets(stats.empty_target_rows, stats.rows_read - len(skipped), cfg, path)


def _prepare(cfg, tokenizer, seed: int, out: Path, source, interrupt) -> dict:
    """Prepare into `out` (train.arrow, eval.arrow); the facts prepared.json keeps (DataStats)."""
    import numpy as np

    path, skip = cfg.path, getattr(cfg, "on_bad_rows", "error") == "skip"
    raw, first, shards = prepare.raw_rows(path, getattr(cfg, "split", "train"), out / "raw.arrow", source, interrupt)
    if first is None:  # no readable row to detect the format from: each is reported, in order
        log = _BadRowLog(shards, skip)
        for r in raw:
            log.bad(r["n"], r["invalid"] or parse_line(r["raw"], r["start"]).reason)
        log.report(good=0)
    fmt = detect_format([first], getattr(cfg, "format", "auto"), path=path)
    renderer = Renderer(tokenizer, fmt, cfg, path)
    max_samples = getattr(cfg, "max_samples", None)
    processes = prepare.num_proc(cfg, len(raw))
    tokens = prepare.run_map(
        raw, renderer, shards, max_length=cfg.max_length, processes=processes, out=out, interrupt=interrupt
    )
    table = tokens.data.table
    kind = table.column("kind").to_numpy()
    bad, dropped = kind == prepare.KINDS["bad"], kind == prepare.KINDS["dropped"]
    good = np.flatnonzero(~bad)
    end = int(good[max_samples - 1]) + 1 if max_samples is not None and len(good) >= max_samples else len(kind)
    numbers, problems = table.column("n").to_numpy()[:end], table.column("problem")
    log = _BadRowLog(shards, skip)
    for i in np.flatnonzero(bad[:end]):
        log.bad(int(numbers[i]), problems[int(i)].as_py())
    log.report(good=int((~bad[:end]).sum()))
    examples = np.flatnonzero(kind[:end] == prepare.KINDS["example"])
    if not len(examples):
        raise DataError(
            f"no example has a trained token within max_length={cfg.max_length} (every completion "
            "starts beyond it); raise data.max_length or shorten the prompts",
            path=path,
        )
    train, eval_ = examples, None
    eval_fraction = getattr(cfg, "eval_fraction", 0.0)
    if eval_fraction:
        _split_problem(len(examples), eval_fraction, path)
        n_eval = max(1, round(len(examples) * eval_fraction))
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        eval_, train = examples[sorted(order[:n_eval])], examples[sorted(order[n_eval:])]
    packing = bool(getattr(cfg, "packing", False))
    lengths = np.concatenate([np.diff(np.asarray(c.offsets)) for c in table.column("input_ids").chunks])
    _write(table, train, lengths, out / "train.arrow", cfg.max_length if packing else None, seed, interrupt)
    if eval_ is not None:
        _write(table, eval_, lengths, out / "eval.arrow", None, seed, interrupt)
    rendered = ~bad[:end]
    stats = DataStats(
        format=fmt,
        rows_read=end,
        rows_skipped=log.skipped,
        train_examples=len(train),
        eval_examples=len(eval_) if eval_ is not None else 0,
        truncated=int((table.column("truncated").to_numpy()[:end] & rendered).sum()),
        packed=packing,
        train_input_tokens=int(lengths[train].sum()),
        # what the shifted loss scores: label 0 of a row never is (finetune/telemetry/meter.py token_counts)
        train_trained_tokens=int(table.column("trained").to_numpy()[train].sum()),
        dropped_no_labels=int(dropped[:end].sum()),
        empty_target_rows=[]
        if getattr(cfg, "train_on_prompt", False)
        else [int(x) for x in numbers[rendered & table.column("empty").to_numpy(zero_copy_only=False)[:end]]],
        files=list(zip(shards.files, shards.rows)),
    )
    for file in out.iterdir():  # the rows read and the map's output: only train and eval stay
        if file.name not in ("train.arrow", "eval.arrow"):
            file.unlink()
    return {"stats": vars(stats), "eval_rows": stats.eval_examples}


def _write(table, rows, lengths, path: Path, pack_length: int | None, seed: int, interrupt) -> None:
    """The examples `rows` of the map's output as an Arrow file, or packed into rows of `pack_length`
    (best-fit decreasing, finetune/data/pack.py), a chunk at a time: no full copy in memory."""
    import pyarrow as pa

    columns = table.select(["input_ids", "labels"])
    names = ("input_ids", "labels") if pack_length is None else ("input_ids", "labels", "position_ids")
    schema = pa.schema([(k, pa.list_(pa.int32())) for k in names])
    groups = None if pack_length is None else bins(lengths[rows].tolist(), pack_length, seed)
    step = 10_000 if groups is None else 2_000
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, len(rows) if groups is None else len(groups), step):
            if interrupt is not None:
                interrupt()
            if groups is None:
                writer.write_table(columns.take(rows[lo : lo + step]).cast(schema))
                continue
            chunk = groups[lo : lo + step]
            part = columns.take(rows[[i for group in chunk for i in group]]).to_pydict()
            pairs = iter(zip(part["input_ids"], part["labels"]))
            packed = [packed_row([Example(*next(pairs)) for _ in group]) for group in chunk]
            writer.write_table(pa.Table.from_pylist(packed, schema=schema))
