"""One rank of `finetune train` with its host syncs and collectives counted per optimizer step
(tests/training/test_sync_count.py launches it in place of finetune/train.py):

    SYNC_COUNT_OUT=DIR accelerate launch ... tests/training/sync_count_rank.py --recipe ddp ...

Counting starts at on_train_begin; each optimizer step's span ends at on_step_end (the counting
callback is added last, after every callback of the run). DIR/rank<r>.json: the spans, the first
caller of each kind. SYNC_COUNT_CONTROL=1 runs the guard as it was before issue 29 instead.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository, not tests/training, on sys.path
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parents[1]))

from transformers import TrainerCallback  # noqa: E402

from finetune.training import resilience, run  # noqa: E402
from tests.training.sync_counter import SyncCounter, TodaysGuard  # noqa: E402


def main() -> int:
    counter = SyncCounter()

    class Spans(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            counter.counts.clear()

        def on_step_end(self, *args, **kwargs):
            counter.mark()

    train = run.train

    def count_and_train(r, t, *args, **kwargs):  # the last phase before Trainer.train: every callback is in
        t.add_callback(Spans())
        return train(r, t, *args, **kwargs)

    run.train = count_and_train
    if os.environ.get("SYNC_COUNT_CONTROL") == "1":
        resilience.ResilientTrainer = TodaysGuard  # finetune/training/build.py imports it at call time
    with counter:
        code = run.main(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    spans = [{f"{kind}|{owner}": n for (kind, owner), n in span.items()} for span in counter.spans]
    where = {"|".join(key): n for key, n in counter.where.items()}
    Path(os.environ["SYNC_COUNT_OUT"], f"rank{rank}.json").write_text(json.dumps({"spans": spans, "where": where}))
    return code


if __name__ == "__main__":
    sys.exit(main())
