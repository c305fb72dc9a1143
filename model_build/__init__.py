"""Build-time tooling: fetch the weights that no PyPI package ships and convert the served models to ONNX.

Run by `make install`, the Docker build and `facesearch models fetch` (all three call `python -m
model_build`). Nothing in the runtime packages (models/, serve_app/) imports this package: a serving
process only reads the converted files (models.weights.converted) and fails at start when one is missing.
"""
