"""Offline face models: detection, alignment, embedding and age estimation on ONNX Runtime.

Nothing in this package knows about Ray, HTTP or tenants; every runner takes numpy arrays in batches.
"""
