"""One training run: the run itself in phases (run.py), its Trainer (trainer.py), the strategy that
engaged, the precision read back, speed options, evaluation."""
