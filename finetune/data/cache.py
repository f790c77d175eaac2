"""Tokenized examples cached across runs (``data.cache_tokenized: true``; docs/speed.md).

The key is a SHA-256 over everything that decides the examples: the data file's bytes, the whole
tokenizer, the data settings that shape rendering and truncation, and FORMAT_VERSION (bump it when
reading, validation, rendering, tokenization or truncation produce other examples). Packing and
the split run after the cache; hub datasets are not cached. Entries are gzip'd JSON, written
atomically, under data.cache_dir, $FINETUNE_CACHE/tokenized or ~/.cache/finetune/tokenized.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Bump when the examples read.py, formats.py, render.py or build.py produce change (labels, text,
# truncation, which rows are skipped), so no run trains on stale cached examples.
FORMAT_VERSION = 2  # 2: entries list the rows whose every target is empty
# Settings of the data section that change the tokenized examples (not packing: applied after).
KEY_FIELDS = (
    "format",
    "split",
    "max_length",
    "train_on_prompt",
    "system_prompt",
    "chat_template",
    "on_bad_rows",
    "max_samples",
)


def default_dir() -> Path:
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune") / "tokenized"


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


def cache_key(data_cfg, tokenizer, path: str) -> str | None:
    """The entry's key, or None when the source has no bytes to hash (a Hub dataset)."""
    if not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(b"\0tokenizer:" + _tokenizer_fingerprint(tokenizer).encode())
    settings = {k: getattr(data_cfg, k, None) for k in KEY_FIELDS}
    h.update(b"\0settings:" + json.dumps(settings, sort_keys=True).encode())
    h.update(b"\0format:" + str(FORMAT_VERSION).encode())
    return h.hexdigest()


class TokenCache:
    def __init__(self, directory: Path, key: str):
        self.path = Path(directory) / f"{key}.json.gz"

    def load(self) -> dict | None:
        if not self.path.exists():
            logger.info("tokenization cache miss: %s", self.path)
            return None
        try:
            with gzip.open(self.path, "rt", encoding="utf-8") as f:
                entry = json.load(f)
        except (OSError, ValueError) as e:  # a damaged entry is rebuilt, and said so
            logger.warning("tokenization cache entry %s is unreadable (%s); tokenizing again", self.path, e)
            return None
        logger.info("tokenization cache hit: %s (%d examples)", self.path, len(entry["examples"]))
        return entry

    def save(self, entry: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tmp-", suffix=".json.gz")
        try:
            with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt", encoding="utf-8") as f:
                json.dump(entry, f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.info("tokenization cache written: %s", self.path)


def for_data(data_cfg, tokenizer, path: str) -> TokenCache | None:
    """The cache for this data and tokenizer, or None when caching is off or not possible."""
    if not getattr(data_cfg, "cache_tokenized", False):
        return None
    key = cache_key(data_cfg, tokenizer, path)
    if key is None:
        logger.info("tokenization cache not used: %s is not a local file", path)
        return None
    return TokenCache(Path(getattr(data_cfg, "cache_dir", None) or default_dir()).expanduser(), key)
