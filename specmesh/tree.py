"""Public import path of specmesh.core.tree, kept stable for external code (docs/architecture.md)."""

from specmesh.core.tree import *  # noqa: F403
