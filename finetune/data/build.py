"""The training datasets from `data.*`: read, validate, render, tokenize, truncate, split, pack.

    bundle = build_datasets(cfg.data, tokenizer, seed=42)   # DataBundle(train, eval, stats)

`check_head` is preflight's look at the first rows (finetune/preflight/checks.py), with the
same messages `build_datasets` would give. Tokenized examples can be cached across runs
(finetune/data/cache.py); the split and packing run after the cache (they depend on the seed
and are cheap).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

from finetune.data.formats import ROW_VALIDATORS, BadRow, detect_format, empty_target
from finetune.data.pack import pack
from finetune.data.read import DataError, Invalid, is_local, read_head, read_numbered
from finetune.data.render import (
    IGNORE_INDEX,
    Example,
    Rendered,
    Renderer,
    TemplateNotPrefixStable,
    progress,
    tokenize,
    tokenizer_name,
    truncate,
)

logger = logging.getLogger(__name__)


_LOG_FIRST_N = 5


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

    def section(self) -> dict:
        """run.json `data`: these fields, the first 50 skipped rows and rows with empty targets."""
        return vars(self) | {"rows_skipped": self.rows_skipped[:50], "empty_target_rows": self.empty_target_rows[:50]}


@dataclass
class DataBundle:
    train: Any  # datasets.Dataset
    eval: Any  # datasets.Dataset | None
    stats: DataStats


def _split(examples: list[Example], eval_fraction: float, seed: int, path: str):
    if not eval_fraction:
        return examples, None
    n = len(examples)
    _split_problem(n, eval_fraction, path)
    n_eval = max(1, round(n * eval_fraction))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx, train_idx = sorted(order[:n_eval]), sorted(order[n_eval:])
    return [examples[i] for i in train_idx], [examples[i] for i in eval_idx]


@dataclass
class _BadRowLog:
    """Applies on_bad_rows: raise on the first bad row, or record it and go on."""

    path: str
    skip: bool
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def bad(self, row: int, reason: str) -> None:
        if not self.skip:
            raise DataError(reason, path=self.path, row=row)
        self.skipped.append((row, reason))

    def report(self, good: int) -> None:
        if not self.skipped:
            return
        first = "; ".join(f"row {n}: {why}" for n, why in self.skipped[:_LOG_FIRST_N])
        if not good:
            raise DataError(f"all {len(self.skipped)} row(s) are bad; first problems: {first}", path=self.path)
        more = " ..." if len(self.skipped) > _LOG_FIRST_N else ""
        logger.warning("%s: skipped %d bad row(s): %s%s", self.path, len(self.skipped), first, more)


def _render_rows(numbered, renderer: Renderer, log: _BadRowLog, max_samples: int | None, path: str, interrupt=None):
    """(rendered rows, rows examined, numbers of the rows whose every target is empty)."""
    rendered: list[Rendered] = []
    empty: list[int] = []
    examined = 0
    for number, row in progress(numbered, len(numbered), "rendering", interrupt=interrupt):
        if max_samples is not None and len(rendered) >= max_samples:
            break
        examined += 1
        if isinstance(row, Invalid):
            log.bad(number, row.reason)
            continue
        try:
            rendered.append(renderer.render(row))
            if empty_target(row, renderer.fmt):
                empty.append(number)
        except BadRow as e:
            log.bad(number, str(e))
        except TemplateNotPrefixStable as e:
            raise DataError(
                f"the chat template of tokenizer {tokenizer_name(renderer.tokenizer)!r} is not prefix-stable "
                f"(rendering the conversation up to turn {e.turn} is not a prefix of the full rendering), so "
                "assistant tokens cannot be located exactly; set data.train_on_prompt: true, or "
                "data.chat_template: false for alpaca/prompt_completion data",
                path=path,
                row=number,
            ) from None
    return rendered, examined, empty


def check_head(cfg, *, max_rows: int = 100) -> list[str]:
    """Preflight for ``cfg.path`` before any weights load: the path is a readable file, and its first
    ``max_rows`` rows read and validate as the detected (or declared) format, with the messages
    ``build_datasets`` would give (finetune/data/read.py read_head: the same readers). When those
    rows are the whole file, the eval split and the share of rows with nothing to train on are
    checked too. Returns the problems (empty: none found). Hub datasets are not checked here (that
    needs the network); the chat template and lengths need the tokenizer, so ``build_datasets``
    checks those."""
    path = cfg.path
    if not is_local(path):
        return []
    try:
        numbered, complete = read_head(path, max_rows, split=getattr(cfg, "split", "train"))
        skip = getattr(cfg, "on_bad_rows", "error") == "skip"
        first = next((row for _, row in numbered if not isinstance(row, Invalid)), None)
        if first is None:
            if skip and not complete:
                return []
            raise DataError(numbered[0][1].reason, path=path, row=numbered[0][0])
        fmt = detect_format([first], getattr(cfg, "format", "auto"), path=path)
        bad, empty = [], []
        for number, row in numbered:
            reason = row.reason if isinstance(row, Invalid) else None
            if reason is None:
                try:
                    ROW_VALIDATORS[fmt](row)
                    if empty_target(row, fmt):
                        empty.append(number)
                except BadRow as e:
                    reason = str(e)
            if reason is not None:
                bad.append(str(DataError(reason, path=path, row=number)))
        # with on_bad_rows: skip, bad rows only stop training when every row of the file is bad
        if bad and (not skip or (complete and len(bad) == len(numbered))):
            more = f" (and {len(bad) - 1} more bad row(s) among the first {len(numbered)})" if len(bad) > 1 else ""
            return [f"data.path: {bad[0]}{more}"]
        if complete:
            good = len(numbered) - len(bad)
            check_empty_targets(empty, good, cfg, path, warn=False)  # the data build warns, once
            used = min(good, getattr(cfg, "max_samples", None) or good)  # data.max_samples: the run's rows
            _split_problem(used, getattr(cfg, "eval_fraction", 0.0), path)
    except DataError as e:
        return [f"data.path: {e}"]
    return []


def check_empty_targets(rows: list[int], good: int, cfg, path: str, *, warn: bool = True) -> None:
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


def _read_and_tokenize(cfg, tokenizer, path: str, on_bad_rows: str, max_length: int, interrupt=None) -> dict:
    """Read, validate, render, tokenize and truncate; a plain-JSON dict (what the cache stores)."""
    numbered = read_numbered(path, split=getattr(cfg, "split", "train"))
    log = _BadRowLog(path, skip=on_bad_rows == "skip")

    # Detect from the first readable row; an unreadable row before it is reported (or
    # skipped) in order by the render loop below.
    first = next((row for _, row in numbered if not isinstance(row, Invalid)), None)
    if first is None:
        for number, row in numbered:
            log.bad(number, row.reason)
        log.report(good=0)
    fmt = detect_format([first], getattr(cfg, "format", "auto"), path=path)

    renderer = Renderer(tokenizer, fmt, cfg, path)
    rendered, examined, empty = _render_rows(
        numbered, renderer, log, getattr(cfg, "max_samples", None), path, interrupt
    )
    log.report(good=len(rendered))

    examples, truncated, dropped = truncate(tokenize(rendered, tokenizer, interrupt), max_length)
    return {
        "format": fmt,
        "examined": examined,
        "skipped": [list(x) for x in log.skipped],
        "truncated": truncated,
        "dropped": dropped,
        "empty_targets": empty,
        "examples": [[ex.input_ids, ex.labels] for ex in examples],
    }


def build_datasets(cfg, tokenizer, *, seed: int, interrupt=None) -> DataBundle:
    """Read, validate, render, tokenize, truncate, split and (optionally) pack ``cfg.path``.
    ``interrupt()``, called per row rendered and per chunk tokenized, may raise to end the build early
    (a stop signal: finetune/training/signals.py check_interrupt)."""
    import datasets

    from finetune.data import cache as token_cache

    path = cfg.path
    on_bad_rows = getattr(cfg, "on_bad_rows", "error")
    if on_bad_rows not in ("error", "skip"):
        raise DataError(f"on_bad_rows must be 'error' or 'skip', got {on_bad_rows!r}")
    max_length = cfg.max_length
    cache = token_cache.for_data(cfg, tokenizer, path)  # data.cache_tokenized: reuse across runs
    entry = cache.load() if cache else None
    if entry is None:
        entry = _read_and_tokenize(cfg, tokenizer, path, on_bad_rows, max_length, interrupt)
        if cache:
            cache.save(entry)
    elif entry["skipped"]:
        logger.warning("%s: skipped %d bad row(s) (from the tokenization cache)", path, len(entry["skipped"]))
    fmt, examined, truncated, dropped = entry["format"], entry["examined"], entry["truncated"], entry["dropped"]
    skipped = [tuple(x) for x in entry["skipped"]]
    check_empty_targets(entry["empty_targets"], examined - len(skipped), cfg, path)
    examples = [Example(ids, labels) for ids, labels in entry["examples"]]
    if not examples:
        raise DataError(
            f"no example has a trained token within max_length={max_length} (every completion "
            "starts beyond it); raise data.max_length or shorten the prompts",
            path=path,
        )
    train, eval_ = _split(examples, getattr(cfg, "eval_fraction", 0.0), seed, path)

    packing = bool(getattr(cfg, "packing", False))
    if packing:
        train_rows = pack(train, max_length, seed)
    else:
        train_rows = [{"input_ids": ex.input_ids, "labels": ex.labels} for ex in train]
    train_ds = datasets.Dataset.from_list(train_rows)
    eval_ds = None
    if eval_ is not None:
        eval_ds = datasets.Dataset.from_list([{"input_ids": ex.input_ids, "labels": ex.labels} for ex in eval_])

    stats = DataStats(
        format=fmt,
        rows_read=examined,
        rows_skipped=skipped,
        train_examples=len(train),
        eval_examples=len(eval_) if eval_ is not None else 0,
        truncated=truncated,
        packed=packing,
        train_input_tokens=sum(len(r["input_ids"]) for r in train_rows),
        # what the shifted loss scores: label 0 of a row never is (finetune/telemetry/meter.py token_counts)
        train_trained_tokens=sum(sum(1 for x in r["labels"][1:] if x != IGNORE_INDEX) for r in train_rows),
        dropped_no_labels=dropped,
        empty_target_rows=[] if getattr(cfg, "train_on_prompt", False) else entry["empty_targets"],
    )
    logger.info(
        "%s: %s data, %d train / %d eval examples, %d train tokens (%d trained)%s",
        path,
        fmt,
        stats.train_examples,
        stats.eval_examples,
        stats.train_input_tokens,
        stats.train_trained_tokens,
        f", packed into {len(train_rows)} rows" if packing else "",
    )
    return DataBundle(train=train_ds, eval=eval_ds, stats=stats)
