"""Fine-tune a causal LM from a recipe. The recipe's strategy is set up by the script itself when the
launcher read no accelerate config; with one, the config sets it up (and must agree with the recipe):

    accelerate launch finetune/train.py --recipe zero2
    accelerate launch --config_file accelerate_configs/zero2.yaml finetune/train.py --recipe zero2 \
        --training.max_steps=100

The launch script only: the run itself is finetune/training/run.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch finetune/train.py`
    # Python put this file's folder first on sys.path; import the package from its parent instead,
    # so the subpackages (data, config, ...) are never found as top-level modules.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parent))

from finetune.errors import exit_without_teardown, imports_without_gc  # noqa: E402

RETURNED = exit_without_teardown()  # before the run's imports: a run that returned skips the interpreter's teardown
from finetune.console import guard_streams  # noqa: E402
from finetune.training import rank_imports, signals  # noqa: E402  (no torch: the handlers come before it)


def main() -> int:
    guard_streams()  # a vanished console must not stop a run from checkpointing (finetune/console.py)
    stops = signals.Stops()
    stops.install()  # before torch is imported (seconds): a signal then is recorded too
    signals.stop_with_parent()
    with imports_without_gc():
        rank_imports.keep_out(sys.argv[1:])  # bitsandbytes, unless the run uses it: before transformers imports peft
        from finetune.training.run import main as run  # torch, transformers, accelerate: after the handlers

    return run(stops=stops)


if __name__ == "__main__":
    RETURNED.append(main())
    sys.exit(RETURNED[0])
