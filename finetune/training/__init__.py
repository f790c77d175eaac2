"""One training run: the phases (run.py), its hooks, Trainer and endings (docs/architecture.md)."""
