"""One rank of the sequence-parallel memory measurement (tests/planning/test_sequence_parallel_memory.py):
the planner's CPU model (tests/planning/mechanism.py) with DeepSpeed's Ulysses attention registered,
one training step on this rank's shard of a long sequence, its peak above the model states from
the allocator events. Run alone for sp 1, or under `torchrun --nproc_per_node SP` (gloo).

    python tests/planning/sequence_parallel_rank.py SEQ_LEN VOCAB OUT_DIR REGIME:KERNEL [...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.planning import mechanism as mech  # noqa: E402


def main(seq: int, vocab: int, out_dir: Path, cases: list[str]) -> None:
    import torch.distributed as dist

    sp = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if sp > 1:
        import types

        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        deepspeed.init_distributed(dist_backend="gloo")
        rank = dist.get_rank()
        # once per process (it creates the sequence-parallel group); every case has these heads
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=types.SimpleNamespace(config=mech.config(vocab_size=vocab)),
            core_attn_implementation="sdpa",
            sequence_parallel_size=sp,
            micro_batch_size=1,
            seq_length_is_variable=True,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in cases:
        regime, kind = case.split(":")
        measured = measure(regime, kind, seq, vocab, sp, rank)
        (out_dir / f"{regime}_sp{sp}_rank{rank}.json").write_text(json.dumps({"sp": sp, "rank": rank, **measured}))
    if sp > 1:
        dist.destroy_process_group()


def measure(regime: str, kind: str, seq: int, vocab: int, sp: int, rank: int) -> dict:
    """One step on this rank's shard of a row of `seq` tokens; its peak above the states."""
    model = mech.build(regime, mech.config(vocab_size=vocab))
    full = mech.batch(vocab, 1, seq)
    # labels shifted over the whole row, then the row cut into sp shards (DeepSpeed's UlyssesSPDataLoaderAdapter)
    shift = torch.nn.functional.pad(full["labels"], (0, 1), value=-100)[..., 1:]
    chunk = seq // sp
    cut = slice(rank * chunk, (rank + 1) * chunk)
    inputs = {
        "input_ids": full["input_ids"][:, cut],
        "position_ids": torch.arange(seq).unsqueeze(0)[:, cut],
        "labels": shift[:, cut],  # ForCausalLMLoss scores shift_labels as given when they are passed
        "shift_labels": shift[:, cut],
    }
    return mech.step_peak(model, inputs, regime, kind)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
