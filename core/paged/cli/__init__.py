"""The ``paged`` command line: serve, chat, complete, run-batch, bench, platforms, env."""
