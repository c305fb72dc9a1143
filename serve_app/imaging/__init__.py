"""Turning uploaded bytes into validated RGB arrays."""
