"""The gateway's HTTP shell: the app, its routes and the rendering of a pipeline result."""
