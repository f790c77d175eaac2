"""`finetune doctor`: prove a machine in minutes, before paying for a long run.

    finetune doctor [--quick] [--offload] [--out DIR] [--recipe R] [--strategies a,b] [--precision P]

Three sections, each a list of lines (ok / problem / skipped, a problem with its one-line fix):

* environment.py (+ devices.py for the GPU facts): versions, GPUs, peer access, host RAM, disk,
  the accelerate default config, W&B, DeepSpeed CPU Adam, bitsandbytes 4-bit;
* links (main.py): `finetune bench-comm` over the machine's processes, beside the link's datasheet
  figure;
* runs.py + agreement.py: a short run of a tiny Llama under every strategy the machine can run
  (through `finetune train`), the engaged-strategy evidence and losses read from each run.json and
  compared with the single-process run within the precision policy's tolerance.

report.py writes the console table, doctor.json and doctor.html; main.py parses the options, ties
the sections together and sets the exit code (0 all well, 1 a problem was found, 2 a bad option). docs/doctor.md has it all.
"""
