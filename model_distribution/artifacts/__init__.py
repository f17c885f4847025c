"""Model artifacts: the files a model is served from, and where they live."""
