"""Public import path of specmesh.core.drafting, kept stable for external code (docs/architecture.md)."""

from specmesh.core.drafting import *  # noqa: F403
