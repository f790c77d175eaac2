"""A model a server can load, proven (docs/usage.md "Export"): the check of every final save against the model that
trained (live.py, in the run; reload.py, the fresh process that loads the save as a user would; figures.py, what is
compared and how closely), the weights of a run from model/ or a checkpoint of any strategy (sources.py), LoRA folded
into the base shard by shard (merge.py), and `finetune export` (command.py).
"""
