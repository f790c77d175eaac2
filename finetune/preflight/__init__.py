"""Preflight: every mistake the configs show, found before any weights load (docs/preflight.md)."""

from finetune.preflight.checks import SOURCE, check_before_loading, check_before_processes, check_launch

__all__ = ["SOURCE", "check_before_loading", "check_before_processes", "check_launch"]
