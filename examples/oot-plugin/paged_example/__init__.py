"""paged-example-plugin: a minimal out-of-tree platform plugin for paged."""
