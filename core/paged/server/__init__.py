"""The OpenAI-compatible HTTP server: `python -m paged.server` or `paged serve`."""
