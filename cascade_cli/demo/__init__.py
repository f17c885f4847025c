"""``cascade demo``: the whole chain on one machine, as a scripted scenario."""
