"""The data prepared once per machine, on `datasets` (docs/speed.md "Data prepared once per machine": the steps, the
cache entry and what its key hashes; docs/data.md "Preparation"). Bump FORMAT_VERSION when reading, validation,
rendering, tokenization or truncation produce other examples. The local main process prepares; the machine's other
ranks wait without a collective (a stop signal still ends the wait). `data.cache_tokenized: false`: every process
prepares its own and keeps nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from finetune import fingerprints, storage
from finetune.data import read
from finetune.data.formats import BadRow, empty_target, with_format_note
from finetune.data.read import Invalid
from finetune.data.render import IGNORE_INDEX, TemplateNotPrefixStable, tokenize, tokenizer_name
from finetune.errors import DataError, UserError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: Arrow entries (train/eval split and packing inside them)
# Settings of the data section that change the prepared examples.
KEY_FIELDS = ("format", "split", "max_length", "train_on_prompt", "system_prompt", "chat_template", "on_bad_rows")
KEY_FIELDS += ("max_samples", "eval_fraction", "packing")
PROGRESS_EVERY_S = 30.0  # a progress line at least this often in a log (a bar on a terminal)
WAIT_POLL_S = 0.2  # how often the other ranks look for the entry
_MIN_ROWS_PER_PROCESS = 10_000  # below this, starting a process costs more than it saves
KINDS = {"example": 0, "bad": 1, "dropped": 2}  # a prepared row: an example, a bad row, no trained token


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    parts = {
        "class": type(tokenizer).__name__,
        "backend": backend.to_str() if backend is not None else None,
        "vocab": None if backend is not None else sorted(tokenizer.get_vocab().items()),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def source_files(path: str, split: str) -> dict[str, Path]:
    """The files whose bytes are the data, by a name relative to the source: a save_to_disk folder's files, the shards
    of a glob or folder, or the one file ("": its name is not part of the data); {} for a Hub dataset."""
    if not read.is_local(path):
        return {}
    if read.arrow_folder(path):
        return {str(f.relative_to(path)): f for f in sorted(Path(path).rglob("*")) if f.is_file()}
    names = [Path(n) for n in read.shard_files(path, split) if os.path.isfile(n)]
    if len(names) == 1:
        return {"": names[0]}
    common = Path(os.path.commonpath([str(n) for n in names]))
    return {str(n.relative_to(common)): n for n in names}


def cache_key(data_cfg, tokenizer, path: str, seed: int, source=None) -> str:
    """The entry's key: the source's bytes (its files' content fingerprints: finetune/fingerprints.py; a Hub dataset's
    fingerprint), the tokenizer, the settings, the seed where a split or packing uses it, FORMAT_VERSION."""
    h = hashlib.sha256()
    if source is not None and not os.path.exists(path):
        h.update(f"hub:{path}:{source._fingerprint}".encode())
    cache = fingerprints.Cache()
    for name, file in source_files(path, getattr(data_cfg, "split", "train")).items():
        h.update(f"\0file:{name}:{cache.of(file)}".encode())
    cache.save()
    h.update(b"\0tokenizer:" + _tokenizer_fingerprint(tokenizer).encode())
    settings = {k: getattr(data_cfg, k, None) for k in KEY_FIELDS}
    settings["seed"] = seed if settings["eval_fraction"] or settings["packing"] else None
    h.update(b"\0settings:" + json.dumps(settings, sort_keys=True).encode())
    h.update(b"\0format:" + str(FORMAT_VERSION).encode())
    return h.hexdigest()


def num_proc(data_cfg, rows: int) -> int:
    """data.num_proc, or the machine's cores (at most 8), 1 below 10,000 rows per process."""
    if getattr(data_cfg, "num_proc", None):
        return data_cfg.num_proc
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, 8, rows // _MIN_ROWS_PER_PROCESS))


def load(data_cfg, tokenizer, seed: int, build, interrupt=None):
    """(train, eval or None, the entry's facts): from the entry, or `build(directory)` (which writes
    train.arrow, eval.arrow and returns the facts) run by the local main process first. A damaged
    or partly deleted entry is said and rebuilt."""
    source = None if read.is_local(data_cfg.path) else read.hub_dataset(data_cfg.path, data_cfg.split)
    root = cache_location(data_cfg)
    key = cache_key(data_cfg, tokenizer, data_cfg.path, seed, source)
    entry, failed = root / key, root / f".failed-{key}-{os.getppid()}"
    shared = bool(getattr(data_cfg, "cache_tokenized", True))
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if shared else 0
    damage = None
    if shared and os.path.lexists(entry):
        try:
            opened = open_entry(entry)
            logger.info("prepared data found: %s", entry)
            return opened
        except Damaged as e:
            damage = str(e)
    if local_rank != 0:
        return _wait(entry, failed, interrupt)
    if damage:
        logger.warning("the prepared data %s is damaged (%s): preparing it again", entry, damage)
        _set_aside(entry)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=root))
    try:
        facts = build(tmp, source)
        written = {f.name: fingerprints.checksum(f) for f in sorted(tmp.glob("*.arrow"))}
        facts["files"] = {name: [(tmp / name).stat().st_size, digest] for name, digest in written.items()}
        (tmp / "prepared.json").write_text(json.dumps(facts))
        ours = True  # the files just written and fingerprinted: not read again to check them
        if not shared:
            entry = tmp
        elif _publish(tmp, entry):
            fingerprints.Cache().note({entry / name: digest for name, digest in written.items()})
        else:
            ours = False
            logger.info("prepared data: another process wrote %s first; using it", entry)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if shared and isinstance(e, DataError):  # the machine's other ranks raise it too
            failed.write_text(str(e))
        raise
    opened = open_entry(entry, verify=not ours)
    if not shared:  # the mapped files stay readable until the process ends
        shutil.rmtree(entry, ignore_errors=True)
    return opened


class Damaged(Exception):
    """A prepared-data entry that cannot be used as it is (said, and prepared again)."""


def open_entry(entry: Path, *, verify: bool = True):
    """(train, eval or None, facts) of a published entry, memory-mapped; Damaged says what is wrong with it: a file
    missing (a cleanup that deleted part of it), cut short or changed since it was written (`verify`: their sizes and
    fingerprints compared with prepared.json's, read once and then cached by stat)."""
    import datasets

    try:
        facts = json.loads((entry / "prepared.json").read_text())
        listed = facts.get("files")
        eval_rows = facts["eval_rows"]
    except FileNotFoundError:
        raise Damaged("prepared.json is missing: the entry was partly deleted") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise Damaged(f"prepared.json does not read ({type(e).__name__}: {e})") from None
    needed = ["train.arrow"] + (["eval.arrow"] if eval_rows else [])
    cache = fingerprints.Cache()
    for name in needed:
        file = entry / name
        if not file.is_file():
            raise Damaged(f"{name} is missing: the entry was partly deleted")
        if verify and listed is not None:  # entries written before the files were listed are opened as they are
            size, digest = listed.get(name) or (None, None)
            if file.stat().st_size != size or cache.of(file) != digest:
                raise Damaged(f"{name} is not the file that was written ({file.stat().st_size} bytes, {size} written)")
    cache.save()
    try:
        train = datasets.Dataset.from_file(str(entry / "train.arrow"))  # memory-mapped
        eval_ = datasets.Dataset.from_file(str(entry / "eval.arrow")) if eval_rows else None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged stream are of several types
        raise Damaged(f"its Arrow files do not read ({type(e).__name__}: {e})") from None
    return train, eval_, facts


def _set_aside(entry: Path) -> None:
    """A damaged entry is moved out of the way (then deleted: finetune wrote it), so no process opens it again."""
    aside = entry.with_name(f".damaged-{entry.name}-{os.getpid()}")
    try:
        entry.rename(aside)
    except OSError:  # another process of this machine moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)


def cache_location(data_cfg) -> Path:
    """The prepared-data cache folder, made if missing; a location that cannot be used is named with the setting that
    chose it and the fix (UserError)."""
    root, setting = _cache_root(data_cfg)
    why = cache_problem(data_cfg)
    if why is None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            Path(tempfile.mkdtemp(prefix=".probe-", dir=root)).rmdir()
            return root
        except OSError as e:  # ACLs, a root-squashed share: what access() did not show
            why = _unusable(root, setting, storage.REASONS.get(e.errno) or e.strerror or str(e))
    raise UserError(why)


def _cache_root(data_cfg) -> tuple[Path, str]:
    if getattr(data_cfg, "cache_dir", None):
        return Path(data_cfg.cache_dir).expanduser(), "data.cache_dir"
    setting = "FINETUNE_CACHE" if os.environ.get("FINETUNE_CACHE") else "the default; FINETUNE_CACHE is unset"
    return fingerprints.cache_root() / "tokenized", setting


def cache_problem(data_cfg) -> str | None:
    """Why the prepared-data cache folder cannot be used (a file on its path, no permission, a read-only disk), with
    the fix; None when it can. Nothing is made or written: preflight asks before any weights load."""
    root, setting = _cache_root(data_cfg)
    there = next(p for p in [root, *root.parents] if os.path.lexists(p))
    if not there.is_dir():
        return _unusable(root, setting, f"{there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        read_only = os.statvfs(there).f_flag & os.ST_RDONLY
        return _unusable(root, setting, f"{there} is on a read-only file system" if read_only else _denied(there))
    return None


def _denied(folder: Path) -> str:
    st = folder.stat()
    return f"permission denied: {folder} has mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid}, this process uid {os.geteuid()}"


def _unusable(root: Path, setting: str, why: str) -> str:
    return (
        f"the prepared-data cache {root} (from {setting}) cannot be used: {why}; set data.cache_dir (or FINETUNE_CACHE) "
        "to a folder you can write"
    )


def _publish(tmp: Path, entry: Path) -> bool:
    try:
        tmp.rename(entry)
        return True
    except OSError:  # another process of this machine (another run) renamed its entry first
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def _wait(entry: Path, failed: Path, interrupt):
    """The other local ranks: the entry once the local main process has published it (or rebuilt a damaged one)."""
    start = last = time.monotonic()
    while True:
        if (entry / "prepared.json").is_file():
            try:
                opened = open_entry(entry)
                logger.info("prepared data opened memory-mapped: %s", entry)
                return opened
            except Damaged:  # the local main process sets it aside and prepares it again
                pass
        if failed.is_file():
            raise DataError(failed.read_text())
        if interrupt is not None:
            interrupt()
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            logger.warning("waiting %.0f s for the local main process to prepare the data (%s)", last - start, entry)
        time.sleep(WAIT_POLL_S)


# --- the rows into Arrow, and the map that prepares them ------------------------------------------------


def raw_rows(path: str, split: str, out: Path, source=None, interrupt=None):
    """The source's rows as a Dataset (an Arrow source as it is; else written to `out`), its first
    readable row (None: every row is unreadable, the map says why) and its Shards (file + row of a number)."""
    import datasets
    import pyarrow as pa

    found = read.arrow_source(path, split) if read.is_local(path) else (source, read.Shards(path, [], [len(source)]))
    if found is not None:
        source, shards = found
        if not len(source):
            raise DataError("contains no rows", path=path)
        return source, source[0], shards
    schema = pa.schema([("n", pa.int64()), ("raw", pa.large_binary()), ("start", pa.int64()), ("invalid", pa.string())])
    first, names, ends = None, read.shard_files(path, split), []
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch: list[tuple] = []
        for n, raw, start, invalid in _numbered_raw(names, ends):
            if first is None and invalid is None:
                row = read.parse_line(raw, start) if start >= 0 else pickle.loads(raw)
                first = None if isinstance(row, Invalid) else row
            batch.append((n, raw, start, invalid))
            if len(batch) == 10_000:
                if interrupt is not None:
                    interrupt()
                writer.write_batch(pa.record_batch(list(map(list, zip(*batch))), schema=schema))
                batch = []
        if batch:
            writer.write_batch(pa.record_batch(list(map(list, zip(*batch))), schema=schema))
    return datasets.Dataset.from_file(str(out)), first, read.Shards(path, names if len(names) > 1 else [], ends)


def _numbered_raw(names: list[str], ends: list[int]):
    """(row number counted across the files, bytes, offset, reason unreadable) of each file's rows in order: JSON lines
    as their bytes (parsed by the map's processes), other rows pickled (they were read here). `ends` gets each file's
    last row number (its Shards)."""
    for name in names:
        offset, last = sum(ends), 0
        for n, raw, start, invalid in _file_raw(name):
            last = n
            yield offset + n, raw, start, invalid
        ends.append(last)


def _file_raw(path: str):
    if read.files.format_name(path).endswith(".jsonl") and read.files.problem(path) is None:
        try:
            lines = list(zip(range(2), read.stream_json_lines(path)))
            if len(lines) > 1:  # one line may be an object holding the rows: read_file looks
                for n, raw, start in read.stream_json_lines(path):
                    yield n, raw, start, None
                return
        except read.ReadWhole:
            pass
    for n, row in read.read_file(path):
        if isinstance(row, Invalid):
            yield n, None, -1, row.reason
        else:
            yield n, pickle.dumps(row), -1, None


def prepare_batch(batch: dict, indices: list[int], *, renderer, shards, max_length: int, stop: str) -> dict:
    """The map's function: each row validated, rendered, tokenized and truncated, in row order: an
    example, a bad row (its reason) or one left with no trained token; runs in the map's processes,
    each a contiguous share of the rows. Bad rows are named together afterwards (finetune/data/build.py)."""
    out = {k: [] for k in ("n", "kind", "problem", "empty", "truncated", "trained", "input_ids", "labels")}
    rendered = []
    arrow = "raw" not in batch
    keys = list(batch)
    for i, index in enumerate(indices):
        if i % 64 == 0 and os.path.exists(stop):
            raise _Stopped
        if arrow:
            n, row = index + 1, {k: batch[k][i] for k in keys}
        else:
            n, raw, start, invalid = batch["n"][i], batch["raw"][i], batch["start"][i], batch["invalid"][i]
            row = Invalid(invalid) if invalid else read.parse_line(raw, start) if start >= 0 else pickle.loads(raw)
        problem, empty = None, False
        if isinstance(row, Invalid):
            problem = row.reason
        else:
            try:
                rendered.append(renderer.render(row))
                empty = empty_target(row, renderer.fmt)
            except BadRow as e:
                problem = with_format_note(str(e), row, renderer.fmt)
            except TemplateNotPrefixStable as e:
                raise shards.error(
                    f"the chat template of tokenizer {tokenizer_name(renderer.tokenizer)!r} is not prefix-stable "
                    f"(rendering the conversation up to turn {e.turn} is not a prefix of the full rendering), so "
                    "assistant tokens cannot be located exactly; set data.train_on_prompt: true, or "
                    "data.chat_template: false for alpaca/prompt_completion data",
                    n,
                ) from None
        out["n"].append(n)
        out["problem"].append(problem)
        out["empty"].append(empty)
    examples = iter(tokenize(rendered, renderer.tokenizer))
    for problem in out["problem"]:
        ids, labels, truncated = [], [], False
        if problem is None:
            ex = next(examples)
            truncated = len(ex.input_ids) > max_length
            ids, labels = ex.input_ids[:max_length], ex.labels[:max_length]
        trained = sum(1 for x in labels[1:] if x != IGNORE_INDEX)
        kept = problem is None and any(x != IGNORE_INDEX for x in labels)
        kind = "bad" if problem is not None else "example" if kept else "dropped"
        out["kind"].append(KINDS[kind])
        out["truncated"].append(truncated)
        out["trained"].append(trained)
        out["input_ids"].append(ids if kept else [])
        out["labels"].append(labels if kept else [])
    return out


class _Stopped(Exception):
    """A stop was asked for (the stop file): the map's processes end early."""


def run_map(raw, renderer, shards, *, max_length: int, processes: int, out: Path, interrupt=None):
    """`raw.map(prepare_batch, batched, num_proc)` with a progress line at least every
    PROGRESS_EVERY_S in a log (a bar on a terminal) and `interrupt()` checked ten times a second: a stop
    reaches the map's processes through a file they look for."""
    import datasets

    stop, done = out / "stop", threading.Event()
    total, start = len(raw), time.monotonic()
    stopped: list[BaseException] = []

    def watch():
        last = start
        while not done.wait(0.1):
            try:
                if interrupt is not None:
                    interrupt()
            except BaseException as e:  # noqa: BLE001 - raised again in the main thread
                stopped.append(e)
                stop.touch()
                return
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                _progress_line(out, total, last - start)

    features = datasets.Features(
        {
            "n": datasets.Value("int64"),
            "kind": datasets.Value("int8"),
            "problem": datasets.Value("string"),
            "empty": datasets.Value("bool"),
            "truncated": datasets.Value("bool"),
            "trained": datasets.Value("int32"),
            "input_ids": datasets.List(datasets.Value("int32")),
            "labels": datasets.List(datasets.Value("int32")),
        }
    )
    bars = datasets.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    watcher = threading.Thread(target=watch, name="finetune-data-progress", daemon=True)
    watcher.start()
    environ = os.environ  # datasets' map with num_proc rebinds os.environ to a copy; code holding the
    try:  # original (defaults such as env=os.environ) would stop seeing later changes
        tokens = raw.map(
            _counted,
            batched=True,
            with_indices=True,
            num_proc=processes if processes > 1 else None,
            fn_kwargs=dict(renderer=renderer, shards=shards, max_length=max_length, stop=str(stop)),
            remove_columns=raw.column_names,
            cache_file_name=str(out / "tokens.arrow"),
            features=features,
            new_fingerprint=out.name,
            desc="preparing the data",
        )
    except _Stopped:
        tokens = None
    finally:
        if os.environ is not environ:
            environ.update(os.environ)
            os.environ = environ  # noqa: B003 - the original object back, its contents unchanged
        done.set()
        watcher.join()
        if bars:
            datasets.enable_progress_bars()
    if stopped:
        logger.warning("data preparation stopped after %d of %d rows", _rows_done(out), total)
        raise stopped[0]
    elapsed = time.monotonic() - start
    logger.info("prepared %d rows in %.1f s (%.0f rows/s, %d process(es))", total, elapsed, total / elapsed, processes)
    return tokens


def _counted(batch, indices, **kw):
    out = prepare_batch(batch, indices, **kw)
    with open(Path(kw["stop"]).parent / f"done-{os.getpid()}", "a") as f:  # the progress line sums these
        f.write(f"{len(indices)}\n")
    return out


def _rows_done(out: Path) -> int:
    done = 0
    for file in out.glob("done-*"):
        try:
            done += sum(int(x) for x in file.read_text().split())
        except (OSError, ValueError):  # being written
            pass
    return done


def _progress_line(out: Path, total: int, elapsed: float) -> None:
    done = _rows_done(out)
    rate = done / elapsed if elapsed else 0.0
    eta = f"{(total - done) / rate:.0f} s" if rate else "unknown"
    logger.info("preparing the data: %d of %d rows (%.0f rows/s, ETA %s)", done, total, rate, eta)
