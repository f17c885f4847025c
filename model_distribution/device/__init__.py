"""A device's side: following its desired state and installing the version it names."""
