"""What a user or a release measures: accuracy, age, the service, vector search, GPUs (docs/performance.md).

Run from the repository root: `python -m bench.accuracy`, `python -m bench.service`, ... (`make bench`).
"""
