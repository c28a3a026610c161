"""The ``rev88`` command line: the front door, above both packages (it may import ``learner`` and ``app``)."""
