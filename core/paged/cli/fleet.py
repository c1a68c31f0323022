"""``paged fleet status URL``: a running server's replicas (GET /fleet) as a table.
``paged fleet ray-resources``: the Ray custom resources of this node's platforms, for
``ray start --resources`` (paged.engine.ray_replicas)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fleet", help="a running server's replicas: status")
    fsub = p.add_subparsers(dest="fleet_command", metavar="ACTION")
    s = fsub.add_parser("status", help="each replica's platform, health, load, speed (GET /fleet)")
    s.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the server's URL")
    s.add_argument("--api-key", default=None, help="API key (default: PAGED_API_KEY)")
    s.add_argument("--json", action="store_true", help="print the JSON as it came")
    s.set_defaults(func=status)
    r = fsub.add_parser(
        "ray-resources",
        help="this node's platforms as Ray custom resources: "
        'ray start --resources "$(paged fleet ray-resources)"',
    )
    r.set_defaults(func=ray_resources)
    p.set_defaults(func=lambda _: p.print_help() or 2)


def _num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(view: dict) -> str:
    """The /fleet answer as text: one row per replica, then the router."""
    head = ("#", "platform", "pid", "health", "restarts", "outstanding", "kv used", "tok/s")
    head += ("prefill/s", "prefix blocks", "node")
    rows = [head]
    for r in view["replicas"]:
        health = r["health"]
        if health == "ready" and r["silent_for"] > 5:
            health = f"silent {r['silent_for']:.0f}s"
        rows.append((
            str(r["index"]), str(r["platform"]), str(r["pid"]), health,
            str(r.get("restarts", 0)), str(r["outstanding_tokens"]),
            f"{100 * r['kv_cache_usage_perc']:.1f}%", _num(r["speed_tokens_per_s"]),
            _num(r["prefill_tokens_per_s"]), str(r["prefix_blocks"]), str(r.get("node") or "-"),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"router: {view.get('router') or 'none (one engine)'}")
    return "\n".join(lines)


def status(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/")
    url = url[:-3] if url.endswith("/v1") else url
    key = args.api_key or os.environ.get("PAGED_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(url + "/fleet", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"error: cannot reach {url}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"error: {url}/fleet answered {r.status_code}: {r.text[:300]}", file=sys.stderr)
        return 1
    view = r.json()
    print(json.dumps(view, indent=2) if args.json else table(view))
    return 0 if all(x["health"] == "ready" for x in view["replicas"]) else 1


def ray_resources(args: argparse.Namespace) -> int:
    """Print {"paged_platform_<name>": 1, ...} for the platforms available here; 1 if none."""
    from paged.engine.ray_replicas import node_resources

    res = node_resources()
    print(json.dumps(res))
    if not res:
        print("error: no platform is available on this node (paged platforms)", file=sys.stderr)
    return 0 if res else 1
