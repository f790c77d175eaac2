"""What a run measures and records: the meter, the formulas, the run record (record.py, docs/run_record.md)
and its sinks (run.json, the console, W&B)."""
