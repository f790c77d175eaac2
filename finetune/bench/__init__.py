"""`finetune bench`: the same workload through this project and through TRL's SFTTrainer (a plain script and a tuned one)."""
