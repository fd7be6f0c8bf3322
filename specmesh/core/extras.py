"""The optional dependencies of an install by role (pyproject.toml's extras, docs/decisions.md).

`pip install specmesh` is the gateway: no torch, no llama.cpp. The gateway imports core modules
for their plain types (SamplingParams, TreeSpec, Verdict, keep_emitted, ...) and never runs their
tensor code, so those modules import torch like this:

    try:
        import torch
    except ModuleNotFoundError as exc:  # a gateway-only install: the tensor code is never called
        torch = missing(exc)

With torch installed nothing changes; without it `torch` is a placeholder whose first use raises
an error naming the extra to install. The model services check up front instead (`require`).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

# the extra that installs each optional top-level module
EXTRA_OF = {"torch": "torch", "llama_cpp": "llama"}


def install_hint(module: str) -> str:
    hint = f"{module} is not installed: pip install 'specmesh[{EXTRA_OF[module]}]'"
    if EXTRA_OF[module] == "torch":
        hint += " (or 'specmesh[llama]', which includes it)"
    return hint


class MissingModule(ModuleType):
    """Stands for an optional module that is not installed; any attribute raises."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):  # copy, pickle, inspect and friends probe for dunders
            raise AttributeError(attr)
        raise ModuleNotFoundError(
            f"{install_hint(self.__name__)} (needed for {self.__name__}.{attr})", name=self.__name__
        )


def missing(exc: ModuleNotFoundError) -> ModuleType:
    """The placeholder for the optional module `exc` could not import; any other failure (a
    broken install, a submodule missing) is raised as it is."""
    if exc.name not in EXTRA_OF:
        raise exc
    return MissingModule(exc.name)


def require(module: str, who: str) -> None:
    """Exit with the extra to install when `module` is not installed (the services' entry points)."""
    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"{who} needs {module}; {install_hint(module)}")
