"""Before and around `accelerate launch`: the launch line and the launch (accelerate.py), what
started this process (launcher.py), who sets up the strategy (strategy_setup.py), what the launch
sets up (configs.py), the launch worked out once (plan.py), CPU rehearsal (cpu_rehearsal.py), the
run directory (rundir.py) and the ranks' heartbeats, watchdog and rank-0 helpers (peers.py)."""
