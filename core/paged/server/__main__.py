"""`python -m paged.server [MODEL] [flags]`: the server without the CLI package."""

if __name__ == "__main__":  # guarded: the engine's spawned process re-imports this module
    import argparse
    import sys

    from paged.server.api import add_serve_args, serve_main

    parser = argparse.ArgumentParser(prog="python -m paged.server")
    add_serve_args(parser)
    sys.exit(serve_main(parser.parse_args()))
