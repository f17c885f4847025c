"""The model registry: published versions, their artifacts and their signed TUF metadata."""
