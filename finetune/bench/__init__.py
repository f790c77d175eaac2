"""`finetune bench`: the same workload through this project and through a plain TRL SFTTrainer script."""
