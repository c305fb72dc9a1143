"""Use cases: creating transactions, processing them, serving results and proofs. No HTTP, no Ray."""
