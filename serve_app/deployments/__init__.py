"""Ray Serve wrappers. The only package (with serve_app/graph.py) that imports Ray."""
