"""vLLM's HTTP flags of `paged serve`: TLS, CORS, a root path behind a proxy, uvicorn's log
level. Each is passed to uvicorn or Starlette (CORSMiddleware) as vLLM passes it."""

from __future__ import annotations

import argparse
import json
import os
import ssl
from typing import Any

UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text[:100]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text[:100]!r}")
    return value


def add_http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP (vLLM's spellings)")
    g.add_argument("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default=None,
                   help="uvicorn's own log level (default: --log-level)")  # fmt: skip
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request from uvicorn")  # fmt: skip
    g.add_argument(
        "--root-path",
        default=None,
        help="the path prefix a proxy serves this server under (it strips the prefix before "
        "forwarding): the OpenAPI page's links and the ASGI root_path carry it",
    )
    g.add_argument(
        "--allowed-origins",
        type=_json_list,
        default=None,
        help="CORS: origins browsers may call from, a JSON list ('[\"*\"]' for any); unset: "
        "no CORS headers (vLLM's default is any origin)",
    )
    g.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help="CORS: allowed methods, a JSON list (default: any)")  # fmt: skip
    g.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help="CORS: allowed request headers, a JSON list (default: any)")  # fmt: skip
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cookies and Authorization headers")  # fmt: skip
    g.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file (PEM)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="TLS: CA certificates to check client certificates with")  # fmt: skip
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
        help="TLS: client certificates: 0 none, 1 optional, 2 required (default: 0)",
    )


def check_http_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag when the HTTP flags cannot work."""
    key, cert = args.ssl_keyfile, args.ssl_certfile
    if bool(key) != bool(cert):
        raise ValueError("ssl_keyfile and ssl_certfile: give both for TLS, or neither")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag}: no such file {path!r}")
    if args.ssl_ca_certs and not cert:
        raise ValueError("ssl_ca_certs: needs --ssl-keyfile and --ssl-certfile")
    if key:  # a key that does not match, or a file that is not PEM: say so now
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"ssl_certfile / ssl_keyfile: cannot load them: {e}") from None
    root = args.root_path
    if root is not None and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"root_path: must start with / and not end with one, got {root!r}")


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keyword arguments of the HTTP flags."""
    return {
        "log_level": args.uvicorn_log_level or args.log_level,
        "access_log": not args.disable_uvicorn_access_log,
        "root_path": args.root_path or "",
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_certfile": args.ssl_certfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "ssl_cert_reqs": args.ssl_cert_reqs,
    }


def with_cors(app: Any, args: argparse.Namespace) -> Any:
    """The app behind CORSMiddleware when --allowed-origins is set. Outermost, so that
    preflight requests need no API key and refusals (401, 413) carry the CORS headers."""
    if args.allowed_origins is None:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(
        app,
        allow_origins=args.allowed_origins,
        allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


def scheme(args: argparse.Namespace) -> str:
    return "https" if args.ssl_certfile else "http"
