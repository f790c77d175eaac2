"""Python imports this at start-up when its folder is on PYTHONPATH: tests/training/strategy_runs.py puts it there,
with SYNC_COUNT_OUT=DIR, for the launches whose host syncs and collectives tests/training/test_sync_count.py counts.
The rank itself is finetune/train.py as users launch it; once it imports finetune/training/run.py, the counting of
tests/training/sync_counter.py count_this_rank starts (SYNC_COUNT_CONTROL=1: with the guard of before issue 29).
Every other process of the launch (the launcher, helpers) only carries the import hook, which never fires there."""

import importlib.abc
import importlib.machinery
import os
import sys

RUN = "finetune.training.run"


class _CountOnceTheRunIsImported(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUN:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def load_and_count(module):
            load(module)
            from tests.training.sync_counter import count_this_rank  # the repository root is on sys.path by now

            count_this_rank(module, os.environ["SYNC_COUNT_OUT"], os.environ.get("SYNC_COUNT_CONTROL") == "1")

        spec.loader.exec_module = load_and_count
        return spec


if os.environ.get("SYNC_COUNT_OUT"):
    sys.meta_path.insert(0, _CountOnceTheRunIsImported())
