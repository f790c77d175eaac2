"""Training data: read -> formats -> render -> build (split, pack) -> collate; the cache; the demo data."""
