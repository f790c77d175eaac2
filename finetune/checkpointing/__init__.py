"""Checkpoints, what wrote them, and resuming a run from one under the same launch or another (docs/faults.md)."""
