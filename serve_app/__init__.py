"""Face search and age estimation service on Ray Serve."""
