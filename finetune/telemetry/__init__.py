"""What a run measures and records: the meter, the formulas, the run record and its sinks (docs/run_record.md)."""
