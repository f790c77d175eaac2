"""`finetune doctor`: prove a machine in minutes, before paying for a long run (docs/doctor.md)."""
