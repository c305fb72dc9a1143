"""Ray Serve wrappers. The only package (with serve_app/launch/) that imports Ray."""
