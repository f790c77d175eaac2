"""Training data: read -> formats -> render (tokens, labels) -> build (split, pack) -> collate; the token cache
and the demo dataset."""
