"""`finetune plan` and `finetune bench-comm`: memory and communication per strategy from a model's config."""
