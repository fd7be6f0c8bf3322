"""Public import path of specmesh.runtime.models, kept stable for external code (docs/architecture.md)."""

from specmesh.runtime.models import *  # noqa: F403
