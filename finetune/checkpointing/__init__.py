"""Checkpoints and resuming: complete checkpoints, what wrote them, and continuing a run from one,
under the same launch or another (docs/faults.md)."""
