"""Content fingerprints of the files a run consumes (base weights, tokenizer, data): xxh3-128 of their bytes, kept in a
small cache keyed by the file's path, size, mtime, ctime, inode and device, so an unchanged 16 GB model is read once,
not on every start (docs/run_record.md `inputs`, with the measured cost). A file rewritten in place changes its ctime
(which no tool can set back), so it is read again. The cache is `$FINETUNE_CACHE/fingerprints.json` (~/.cache/finetune
by default); a cache that cannot be written is said once and the files are read every time.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TypedDict

import xxhash

ALGORITHM = "xxh3_128"  # not cryptographic: finds change and damage at ~3 GB/s on one core
_BLOCK = 1 << 23
_MAX_ENTRIES = 20_000  # the oldest entries are dropped beyond this (a cache, not a record)

log = logging.getLogger(__name__)
_unwritable: set[str] = set()  # caches already said to be unusable in this process


class Inputs(TypedDict):
    """What the run is made from: content fingerprints (finetune/checkpointing/provenance.py inputs):
    run.json `inputs`, and the checkpoint marker's run block."""

    algorithm: str  # xxh3_128
    weights: str | None  # the base model's config.json and weight files together; null: not on this machine
    weight_files: dict[str, str]  # file (relative to the model folder) -> fingerprint
    snapshot: str | None  # a hub id's: the commit of the cached snapshot its weights were read from; null: a folder
    tokenizer: str | None  # the tokenizer's files, tokenizer_config.json without its chat_template
    tokenizer_files: dict[str, str]
    chat_template: str | None  # its files and tokenizer_config.json's chat_template; null: none, or not used
    chat_template_files: dict[str, str]  # file, or tokenizer_config.json:chat_template -> fingerprint
    data: str | None  # the data files together; null: a Hub dataset
    data_files: dict[str, str]  # file (relative to their common folder; "" for one file) -> fingerprint
    heldout: str | None  # eval.heldout_path's files together; null: no held-out file
    heldout_files: dict[str, str]  # likewise
    settings: str  # the configuration that decides what is trained (provenance.settings)
    read_bytes: int  # bytes read to fingerprint them (0: every file's fingerprint was cached)
    seconds: float  # time taken to fingerprint them


class InputChange(TypedDict):
    input: str  # weights | tokenizer | chat_template | data | heldout | settings
    said: str  # what changed, in words: the fingerprints and the files


def cache_root() -> Path:
    """finetune's cache directory: $FINETUNE_CACHE, else ~/.cache/finetune."""
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")


def checksum(path: Path | str) -> str:
    """xxh3-128 of every byte of `path`."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def of_text(text: str | bytes) -> str:
    return xxhash.xxh3_128(text.encode() if isinstance(text, str) else text).hexdigest()


def of_parts(parts: dict[str, str | None]) -> str:
    """One fingerprint of named fingerprints (a folder's files, a run's inputs): order-independent."""
    return of_text(json.dumps(parts, sort_keys=True))


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class Cache:
    """The files' fingerprints by path and stat; `of(path)` reads a file only when it is new or changed."""

    def __init__(self, path: Path | None = None):
        self.path = path or cache_root() / "fingerprints.json"
        self.entries = self._read()
        self.changed = False
        self.bytes_read = 0  # what this process hashed (not cached): the cost the cache saves

    def _read(self) -> dict:
        try:
            value = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # none yet, or damaged: rebuilt as files are read
            return {}
        return value if isinstance(value, dict) else {}

    def of(self, path: Path | str) -> str:
        path = Path(path).resolve()
        key = _stat_key(path)
        entry = self.entries.get(str(path))
        if isinstance(entry, list) and entry[:-1] == key:
            return entry[-1]
        digest = checksum(path)
        self.bytes_read += key[0]
        self.entries.pop(str(path), None)  # re-inserted last: the newest entries survive trimming
        self.entries[str(path)] = [*key, digest]
        self.changed = True
        return digest

    def note(self, digests: dict[Path, str]) -> None:
        """Fingerprints this process computed of files it wrote (then moved): kept without reading them again."""
        for path, digest in digests.items():
            path = Path(path).resolve()
            self.entries[str(path)] = [*_stat_key(path), digest]
        self.changed = True
        self.save()

    def save(self) -> None:
        """Write the cache atomically; an unusable cache directory is said once, never an error."""
        if not self.changed:
            return
        entries = dict(list(self.entries.items())[-_MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".fingerprints-", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(entries, f)
            os.replace(tmp, self.path)
            self.changed = False
        except OSError as e:
            if str(self.path) not in _unwritable:
                _unwritable.add(str(self.path))
                log.warning(
                    "the fingerprint cache %s cannot be written (%s): input files are read in full on every start; "
                    "point FINETUNE_CACHE at a writable directory",
                    self.path,
                    e.strerror or e,
                )
