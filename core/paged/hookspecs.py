"""Hook specifications of the `paged` plugin contract (docstring-only, as pluggy wants).

A plugin distribution declares ``[project.entry-points.paged] NAME = "module"``; the module
holds ``@paged.hookimpl`` functions. Importing it must not import vendor modules or touch a
device: return classes and let the engine instantiate them.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("paged")
hookimpl = pluggy.HookimplMarker("paged")

# Bumped when the contract changes incompatibly; plugins may check it.
PLUGIN_API_VERSION = 1


@hookspec
def paged_platforms() -> list[type]:
    """Return Platform subclasses (classes, not instances) this plugin provides."""


@hookspec
def paged_models() -> dict[str, type]:
    """Return extra model architectures: HF ``architectures`` name -> nn.Module class."""
