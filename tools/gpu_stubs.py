"""Stand-ins for GPU-only packages, so a framework's CPU-side code (argument parsers, config classes, model
builders on the meta device) imports on a machine without them. Used by the export checks in ``tools/``, each
in its own process: never import this into the test process itself.

A stand-in module accepts any attribute: lower-case names are mocks (decorators such as ``triton.jit``, version
checks), capitalised names are classes that take any arguments and have any attribute (``isinstance`` needs a
type). Nothing of the framework itself is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import typing
from unittest import mock

try:  # torch's Stateful and others are typing_extensions Protocols
    import typing_extensions

    _PROTOCOL_META = type(typing_extensions.Protocol)
except ImportError:
    _PROTOCOL_META = type(typing.Protocol)

STUBBED = ("triton", "transformer_engine", "apex", "flash_attn", "flashattn_hopper", "nvidia_resiliency_ext",
           "mamba_ssm", "causal_conv1d", "grouped_gemm", "nv_grouped_gemm", "emerging_optimizers", "tensorstore",
           "zarr", "modelopt", "nvtx", "megatron_fsdp_kernels", "deep_ep", "tilelang", "cuda", "cupy")  # fmt: skip


class _StubClass(_PROTOCOL_META):  # so a class may derive from a stand-in and a Protocol (ABCMeta) class
    """Classes of stand-in modules: any class attribute is a mock (``SomeFunction.apply``)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{cls.__name__}.{name}")


def _instance_attr(self, name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return mock.MagicMock(name=f"{type(self).__name__}().{name}")


def _accept(*_args, **_kwargs) -> None:
    return None


def _mock(*_args, **_kwargs) -> mock.MagicMock:
    return mock.MagicMock()


_STUB_INSTANCE = {"__init__": _accept, "__call__": _mock, "__getattr__": _instance_attr}  # any arguments, attributes


class _Stub(types.ModuleType):
    """A module whose every attribute is a mock (enough for import-time decorators and version checks)."""

    __path__: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name.lstrip("_")[:1].isupper():  # a class (isinstance checks need a type)
            value = _StubClass(name, (), dict(_STUB_INSTANCE))
        else:
            value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, _path, _target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__version__ = "99.0.0"
        return module

    def exec_module(self, _module):
        return None


def install_stubs(extra: tuple[str, ...] = ()) -> None:
    """Serve :data:`STUBBED` packages and ``extra`` ones (and their submodules) as stand-ins in this process."""
    sys.meta_path.insert(0, _StubFinder(STUBBED + extra))
