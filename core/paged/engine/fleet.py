"""Fleet files (`paged serve --fleet FLEET.yaml`): one model, groups of replicas by platform.

    model: path/or/default          # optional: else the command line's model
    args: {dtype: float32}          # optional: engine arguments of every group
    replicas:
      - {platform: cpu, count: 2, args: {max_num_seqs: 32}}
      - {platform: example, count: 1}

`args` take any `paged serve` engine flag by its EngineConfig name (max_num_seqs, or
max-num-seqs) and the platforms' options (cpu_native, ...); a group's args override the
file's, which override the command line's. Errors name the file, line and field
(FleetError): `parse_fleet` / `load_fleet` check the file itself (fields, types, duplicate
keys, engine arguments); before anything starts, the server also runs `check_platforms`
(installed ones) and `check_size` (what this host can run) for replicas on this host, and
`check_groups` (each group's config against the model's config.json). `build_fleet` starts
nothing: it returns the ReplicaSet of engine-core processes on this host, each with its
platform forced and its share of the host's cores.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from paged.config import EngineConfig, platform_options

log = logging.getLogger("paged")
# EngineConfig fields a fleet file may not set in args: the file says them itself.
NOT_ARGS = {"model": "model", "platform": "platform", "data_parallel_size": "count"}


class FleetError(ValueError):
    """An invalid fleet file: the message names the file, line and field."""


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid")
    platform: str = Field(min_length=1)
    count: int = Field(default=1, ge=1, strict=True)  # strict: `true` is not 1
    args: dict[str, Any] = Field(default_factory=dict)
    # with Ray: CPUs (threads) each replica reserves
    num_cpus: int = Field(default=1, ge=1, strict=True)


class Fleet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    replicas: list[Group] = Field(min_length=1)
    _name: str = PrivateAttr("<fleet>")  # the file, and its YAML node tree: for the lines of
    _root: Any = PrivateAttr(None)  # errors found after parsing (fleet_error)

    @property
    def size(self) -> int:
        return sum(g.count for g in self.replicas)


# ---- parsing -----------------------------------------------------------------------------
def _lines(text: str) -> Any:
    """The YAML node tree (for line numbers), or None when it cannot be composed."""
    import yaml

    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None


def _line_of(root: Any, path: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest node of `path` in the YAML tree (a key's own line for
    mappings: where the field is written)."""
    import yaml

    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in path:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.value == str(part):
                    node, line = v, k.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _field(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(file)"


def _err(name: str, root: Any, path: tuple[Any, ...], msg: str) -> FleetError:
    line = _line_of(root, path)
    where = f"{name}:{line}" if line else name
    return FleetError(f"{where}: {_field(path)}: {msg}")


def _engine_fields() -> dict[str, dataclasses.Field]:
    return {
        f.name: f
        for f in dataclasses.fields(EngineConfig)
        if f.metadata.get("cli", True) and f.name not in NOT_ARGS
    }


def _check_args(args: dict[str, Any], name: str, root: Any, at: tuple[Any, ...]) -> dict[str, Any]:
    """Engine args by EngineConfig name (dashes allowed), coerced by the flag's type; unknown
    ones are an error naming them and listing what is known."""
    fields, options = _engine_fields(), platform_options()
    out: dict[str, Any] = {}
    for key, value in args.items():
        k = str(key).replace("-", "_")
        where = (*at, key)
        if k in NOT_ARGS:
            raise _err(name, root, where, f"set {NOT_ARGS[k]!r} in the fleet file, not in args")
        if k in options:
            out[k] = value
            continue
        if k not in fields:
            known = ", ".join(sorted(fields) + sorted(options))
            raise _err(name, root, where, f"unknown engine argument {key!r} (known: {known})")
        f = fields[k]
        conv = f.metadata.get("type")
        if f.type in ("bool", bool, "bool | None"):
            if not isinstance(value, bool) and value is not None:
                raise _err(name, root, where, f"expected true or false, got {value!r}")
        elif conv is not None and value is not None:
            try:
                value = conv(value) if not isinstance(value, bool) else _bad(value)
            except (TypeError, ValueError) as e:
                raise _err(name, root, where, f"invalid value {value!r}: {e}") from None
        elif value is not None and not isinstance(value, str):
            raise _err(name, root, where, f"expected a string, got {value!r}")
        out[k] = value
    return out


def _bad(value: Any) -> Any:
    raise ValueError("expected a number")


def _duplicates(name: str, node: Any, path: tuple[Any, ...] = ()) -> None:
    """FleetError at the second of two equal keys in any mapping (YAML keeps the last one
    silently; a fleet file that says a field twice is a mistake)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None and key in seen:
                line = k.start_mark.line + 1
                raise FleetError(f"{name}:{line}: {_field((*path, key))}: duplicate key {key!r}")
            if key is not None:
                seen.add(key)
            _duplicates(name, v, (*path, key) if key is not None else path)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _duplicates(name, v, (*path, i))


def parse_fleet(text: str, name: str = "<fleet>") -> Fleet:
    """Validate a fleet file's text (YAML, or JSON: a subset of it). FleetError on any error."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        raise FleetError(f"{where}: not valid YAML: {getattr(e, 'problem', None) or e}") from None
    root = _lines(text)
    _duplicates(name, root)
    if not isinstance(data, dict):
        raise _err(name, root, (), "expected a mapping with 'model' and 'replicas'")
    try:
        fleet = Fleet.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = tuple(first["loc"])
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = f"unknown field {loc[-1]!r}"
        raise _err(name, root, loc, msg) from None
    fleet.args = _check_args(fleet.args, name, root, ("args",))
    for i, g in enumerate(fleet.replicas):
        g.args = _check_args(g.args, name, root, ("replicas", i, "args"))
    fleet._name, fleet._root = name, root
    return fleet


def load_fleet(path: str | Path) -> Fleet:
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise FleetError(f"cannot read the fleet file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise FleetError(f"{p}: not UTF-8 text (byte {e.start})") from None
    return parse_fleet(text, str(p))


def fleet_error(fleet: Fleet, path: tuple[Any, ...], msg: str) -> FleetError:
    """A FleetError naming the file, the line of `path` in it and the field."""
    return _err(fleet._name, fleet._root, path, msg)


def check_platforms(fleet: Fleet) -> None:
    """FleetError for a group whose platform no installed plugin provides (paged.plugins;
    one that is installed but unavailable here fails the start-up instead). Replicas on this
    host only: with Ray, the nodes' plugins matter, not this one's."""
    from paged.plugins import all_platforms

    names = sorted(cls.name for cls in all_platforms())
    for i, g in enumerate(fleet.replicas):
        if g.platform not in names:
            known = ", ".join(names) or "none: pip install paged[cpu]"
            msg = f"unknown platform {g.platform!r} (installed: {known})"
            raise fleet_error(fleet, ("replicas", i, "platform"), msg)


def check_groups(fleet: Fleet, configs: list[EngineConfig], check: Any) -> None:
    """`check(config)` (serving_stack.check_model: what the model's config.json allows) on
    each group's config; its ValueError as a FleetError naming the group, and the line of the
    argument it names when the file sets it."""
    k = 0
    for i, g in enumerate(fleet.replicas):
        try:
            check(configs[k])
        except ValueError as e:
            msg = str(e)
            field = msg.split(":", 1)[0] if ": " in msg else ""
            path: tuple[Any, ...] = ("replicas", i)
            if field in g.args:
                path = ("replicas", i, "args", field)
            elif field in fleet.args:
                path = ("args", field)
            where = _line_of(fleet._root, path)
            at = f"{fleet._name}:{where}" if where else fleet._name
            raise FleetError(f"{at}: replicas[{i}] ({g.platform}): {msg}") from None
        k += g.count


def check_size(fleet: Fleet, configs: list[EngineConfig]) -> None:
    """FleetError when the fleet's replicas cannot all run on this host
    (placement.check_local_replicas: too many per core, or more devices than it shows), at
    the count of the group that overflows."""
    from paged.engine.placement import check_local_replicas
    from paged.plugins import platform_class

    groups: list[tuple[str, Any, int, int]] = []
    k = 0
    for i, g in enumerate(fleet.replicas):
        cfg = configs[k]
        groups.append((g.platform, platform_class(g.platform), cfg.world_size, g.count))
        k += g.count
        try:
            check_local_replicas(groups)
        except ValueError as e:
            raise fleet_error(fleet, ("replicas", i, "count"), str(e)) from None


# ---- building ----------------------------------------------------------------------------
def group_configs(fleet: Fleet, base: EngineConfig, name: str = "<fleet>") -> list[EngineConfig]:
    """One EngineConfig per replica: the command line's, then the file's args, then the
    group's, with the model and the group's platform; data_parallel_size 1."""
    opts = platform_options()
    out = []
    for i, g in enumerate(fleet.replicas):
        merged = {**fleet.args, **g.args}
        kw = {k: v for k, v in merged.items() if k not in opts}
        po = {**base.platform_options, **{k: v for k, v in merged.items() if k in opts}}
        try:
            cfg = dataclasses.replace(
                base,
                **kw,
                model=fleet.model or base.model,
                platform=g.platform,
                data_parallel_size=1,
                platform_options=po,
            )
        except ValueError as e:  # EngineConfig's own checks
            raise FleetError(f"{name}: replicas[{i}] ({g.platform}): {e}") from None
        out.extend([cfg] * g.count)
    return out


def build_fleet(
    fleet: Fleet,
    base: EngineConfig,
    log_level: str = "info",
    tokenizer_loader: Any = None,
    faults: Any = None,
    router: str = "prefix",
    name: str = "<fleet>",
    ray_address: str | None = None,
) -> Any:
    """The fleet's ReplicaSet (not started): replicas in file order, each on this host's
    next share of the cores (placement.placements over all of them) and, for device platforms,
    its next world_size devices; with ray_address, each in a Ray actor on a node that
    advertises its platform (paged.engine.ray_replicas). FleetError when the Ray cluster
    cannot be reached or no node has a group's platform."""
    from paged.engine.replicas import _load_once

    configs = group_configs(fleet, base, name)
    load = _load_once(tokenizer_loader)
    if ray_address:
        return _ray_fleet(fleet, configs, log_level, load, faults, router, name, ray_address)
    return _local_fleet(configs, log_level, load, faults, router)


def _local_fleet(
    configs: list[EngineConfig],
    log_level: str,
    load: Any,
    faults: Any,
    router: str,
) -> Any:
    from paged.engine.async_engine import AsyncEngine
    from paged.engine.placement import assign_devices, cores
    from paged.engine.replicas import Replica, ReplicaSet
    from paged.plugins import platform_class

    shares = cores(len(configs))
    classes = {name: platform_class(name) for name in {c.platform for c in configs}}
    assign_devices(shares, [classes[c.platform] for c in configs], [c.world_size for c in configs])
    replicas = []
    for p, cfg in zip(shares, configs):

        def factory(cfg: EngineConfig = cfg, p: Any = p) -> AsyncEngine:
            return AsyncEngine(
                cfg, log_level, load, faults, placement=p, name=f"paged-core-{p.index}"
            )

        replicas.append(Replica(p.index, factory(), p, factory))
    desc = ". ".join(f"{p.describe()} [{c.platform}]" for p, c in zip(shares, configs))
    log.info("fleet: %d replicas, router %s (%s)", len(configs), router, desc)
    return ReplicaSet(replicas, same_platform=False, router=router)


def _ray_fleet(
    fleet: Fleet,
    configs: list[EngineConfig],
    log_level: str,
    load: Any,
    faults: Any,
    router: str,
    name: str,
    address: str,
) -> Any:
    from paged.engine import ray_replicas as rr
    from paged.engine.placement import Placement
    from paged.engine.replicas import Replica, ReplicaSet

    try:
        rr.connect(address)
        rr.check_platforms([c.platform or "" for c in configs])
    except (RuntimeError, ConnectionError) as e:
        raise FleetError(f"{name}: Ray at {address}: {e}") from None
    groups = [g for g in fleet.replicas for _ in range(g.count)]
    replicas = []
    for i, (cfg, g) in enumerate(zip(configs, groups)):
        p = Placement(i, None, g.num_cpus, {"OMP_NUM_THREADS": str(g.num_cpus)})
        opts = rr.actor_options(cfg.platform or "", cfg.world_size, g.num_cpus)

        def factory(cfg: EngineConfig = cfg, p: Placement = p, opts: dict = opts) -> Any:
            return rr.RayEngine(cfg, log_level, load, faults, placement=p,
                                name=f"paged-core-{p.index}", options=opts)  # fmt: skip

        replicas.append(Replica(i, factory(), p, factory))
    desc = ", ".join(f"{g.count} x {g.platform} ({g.num_cpus} CPUs each)" for g in fleet.replicas)
    log.info("fleet on Ray at %s: %s, router %s", address, desc, router)
    return ReplicaSet(replicas, same_platform=False, router=router)
