"""Public import path of specmesh.runtime.engine, kept stable for external code (docs/architecture.md)."""

from specmesh.runtime.engine import *  # noqa: F403
