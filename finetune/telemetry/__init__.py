"""What a run measures and records: the meter, the formulas, the run record (record.py, docs/run_record.md),
the machine, the end-of-run summary, W&B."""
