"""paged-cpu: the CPU platform plugin for paged."""
