"""The ``cascade`` command: the one place that composes the packages (edge agent, cloud tier,
fleet, sync) into subcommands, each imported lazily, so that ``cascade edge`` never loads torch;
and the programs that drive several deployables at once (``demo``, ``calibrate``)."""
