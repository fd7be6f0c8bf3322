"""Public import path of specmesh.core.verification, kept stable for external code (docs/architecture.md)."""

from specmesh.core.verification import *  # noqa: F403
