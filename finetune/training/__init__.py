"""One training run: the run itself (run.py), the trainer, the engaged strategy, guards against faults,
checkpoints and resume, evaluation."""
