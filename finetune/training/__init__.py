"""One training run: the phases (run.py), what is recorded and checked around training (hooks.py), its
Trainer (trainer.py, resilience.py), how it ends (endings.py); docs/architecture.md."""
