"""Public import path of specmesh.core.sampling, kept stable for external code (docs/architecture.md)."""

from specmesh.core.sampling import *  # noqa: F403
