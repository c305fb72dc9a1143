"""HTTP layer: request parsing, authentication, responses. Knows nothing of Ray or model internals."""
