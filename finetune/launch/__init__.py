"""Before and around `accelerate launch`: what a launch sets up (facts.py), the checks before any
weights load (preflight.py), the run directory (rundir.py), the launch line and the launch itself
(accelerate.py), CPU rehearsal (cpu_rehearsal.py), the train script's arguments (script_args.py)
and doing something once on rank 0 (ranks.py)."""
