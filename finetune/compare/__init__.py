"""`finetune compare` and `finetune sweep`: run records side by side, plots, reports, W&B."""
