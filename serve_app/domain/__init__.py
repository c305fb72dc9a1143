"""Plain data and errors of the service: no I/O, no frameworks."""
