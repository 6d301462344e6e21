"""Package namespaces whose names load their module on first use (PEP 562), so that importing a package (or
any module inside it, which imports the package first) does not import torch and the whole library: the
command line parses its arguments, and answers --help, before anything heavy loads."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, modules: dict[str, str]):
    """(__getattr__, __dir__) for a package's `namespace` (its globals()): `modules` maps a module to the names it
    provides, space-separated ("snlp.method.preheat": "Preheat CalibrateConfig fit_preheat=fit" exports its `fit`
    as fit_preheat). A name is imported on first access and then cached in the namespace."""
    where: dict[str, tuple[str, str]] = {}
    for module, names in modules.items():
        for item in names.split():
            public, _, attr = item.partition("=")
            where[public] = (module, attr or public)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        module, attr = where[name]
        value = getattr(importlib.import_module(module), attr)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
