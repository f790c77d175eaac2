"""Before and around `accelerate launch`: what a launch sets up (facts.py), the checks before any weights load
(preflight.py), the launch line (accelerate.py), CPU rehearsal (cpu_rehearsal.py), the train script's arguments."""
