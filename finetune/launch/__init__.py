"""Before and around `accelerate launch`: the launch, the run directory, heartbeats (docs/architecture.md)."""
