"""A stand-in for ``torchvision``, visible to SGLang's modules only, for CPU tests of the SGLang plugin.

SGLang 0.5.23's config package imports ``torchvision.transforms`` at import time for multimodal
models the plugin never serves, and the only torchvision on the package index pulls a CUDA torch.
This finder serves placeholder modules to imports made from ``sglang.*`` modules; every other
caller (transformers' availability probe in particular) still sees that torchvision is absent.
Calling anything from a placeholder raises ``ImportError``. Installed only when torchvision is missing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Placeholder:
    """Any attribute of the stand-in modules: usable as a name, fails loudly when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self._name}: torchvision is not installed (CPU test stand-in)")

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")


def _module_getattr(module_name: str):
    def __getattr__(name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{module_name}.{name}")

    return __getattr__


def _importer_module() -> str:
    """``__name__`` of the module whose import statement is being resolved (first frame outside importlib)."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib") or frame.f_globals.get("__name__") == __name__
    ):
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


class _TorchvisionForSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] != "torchvision" or not _importer_module().startswith("sglang."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: every attribute is a placeholder."""


def install() -> None:
    """Put the stand-in on ``sys.meta_path`` unless a real torchvision (or the stand-in) is there already."""
    if any(isinstance(finder, _TorchvisionForSGLang) for finder in sys.meta_path):
        return
    if importlib.util.find_spec("torchvision") is None:
        sys.meta_path.append(_TorchvisionForSGLang())
