"""Before and around `accelerate launch`: what a launch sets up (facts.py), what started this
process and which accelerate config it read (launcher.py), who sets up the strategy, the launcher's
config or the recipe from inside the script (setup.py), the checks before any weights load
(preflight.py), the run directory (rundir.py), the launch line and the launch itself
(accelerate.py), CPU rehearsal (cpu_rehearsal.py), the train script's arguments (script_args.py)
and doing something once on rank 0 (ranks.py)."""
