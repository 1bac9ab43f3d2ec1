"""xfer for Python: transfer agents for KV-cache traffic.

The native API (``Agent``, ``Registration``, ``PreparedLocal``, ``PreparedRemote``,
``Request``, ``Grant``, ``GrantOffer``, ``XferError``) comes from the Rust extension
``pd_xfer._native``. This module
adds ``regions()``, which turns the objects engines hold (torch tensors, numpy arrays, writable
buffers, ``(addr, len, dev_id)`` tuples) into the descriptor tuples the agent takes, and
``register()``, which registers such objects and keeps them alive while registered, and
``load_cufile()``, which makes PyPI's cuFile findable by the GDS backend.

``pd_xfer.nixl`` offers NIXL's Python agent (``nixl_agent``) over this API, and
``pd_xfer.vllm`` a vLLM KV connector that uses it.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from typing import Any, Iterable

from ._native import Agent, Grant, GrantOffer, PreparedLocal, PreparedRemote, Registration, Request, XferError

XferError.__module__ = "pd_xfer"

__all__ = [
    "Agent",
    "Grant",
    "GrantOffer",
    "PreparedLocal",
    "PreparedRemote",
    "Registration",
    "Request",
    "XferError",
    "load_cufile",
    "memory_type_of",
    "register",
    "regions",
]


def _invalid(message: str) -> XferError:
    error = XferError(message)
    error.kind = "invalid_argument"
    return error


def _is_tensor(obj: Any) -> bool:
    return callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "nbytes")


def _device_id(obj: Any) -> int:
    device = getattr(obj, "device", None)
    index = getattr(device, "index", None)
    return int(index) if index is not None else 0


def _region_of(obj: Any) -> tuple[int, int, int]:
    if _is_tensor(obj):
        return int(obj.data_ptr()), int(obj.nbytes), _device_id(obj)
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None and not _is_descriptor_array(obj):
        address, readonly = interface["data"]
        if readonly:
            raise _invalid("a read-only array cannot be registered (peers may write into it)")
        return int(address), int(obj.nbytes), 0
    if isinstance(obj, (bytearray, memoryview)):
        view = memoryview(obj)
        if view.readonly:
            raise _invalid("a read-only buffer cannot be registered (peers may write into it)")
        if view.nbytes == 0:
            raise _invalid("an empty buffer cannot be registered")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return address, view.nbytes, 0
    if isinstance(obj, (tuple, list)) and len(obj) in (3, 4) and all(isinstance(v, int) for v in obj[:3]):
        # NIXL's registration tuples carry a fourth, string field (metadata); xfer has no use for it.
        return int(obj[0]), int(obj[1]), int(obj[2])
    raise _invalid(
        f"cannot describe a {type(obj).__name__} as memory: expected (addr, len, dev_id) tuples, "
        "tensors (data_ptr()/nbytes), numpy arrays or writable buffers"
    )


def _is_descriptor_array(obj: Any) -> bool:
    """A numpy array of shape (N, 3) or (N, 4) of integers: NIXL's descriptor-array form."""
    shape = getattr(obj, "shape", None)
    kind = getattr(getattr(obj, "dtype", None), "kind", "")
    return shape is not None and len(shape) == 2 and shape[1] in (3, 4) and kind in "iu"


def regions(objs: Any) -> list[tuple[int, int, int]]:
    """Descriptor tuples ``(addr, len, dev_id)`` for one object or a list of them."""
    if _is_descriptor_array(objs):
        return [(int(row[0]), int(row[1]), int(row[2])) for row in objs.tolist()]
    if _is_tensor(objs) or isinstance(objs, (bytearray, memoryview)) or hasattr(objs, "__array_interface__"):
        return [_region_of(objs)]
    if isinstance(objs, tuple) and len(objs) in (3, 4) and all(isinstance(v, int) for v in objs[:3]):
        return [_region_of(objs)]
    if isinstance(objs, Iterable):
        return [_region_of(obj) for obj in objs]
    return [_region_of(objs)]


def memory_type_of(objs: Any, default: str = "DRAM") -> str:
    """``VRAM`` for CUDA tensors, else ``default``."""
    first = objs[0] if isinstance(objs, (list, tuple)) and objs and not isinstance(objs[0], int) else objs
    device = getattr(first, "device", None)
    if getattr(device, "type", None) == "cuda":
        return "VRAM"
    return default


def register(agent: Agent, objs: Any, mem_type: str | None = None) -> Registration:
    """Registers tensors, arrays, buffers or tuples; the objects stay alive while registered."""
    return agent.register_memory(regions(objs), mem_type or memory_type_of(objs), keep_alive=objs)


def load_cufile() -> str | None:
    """Loads cuFile from PyPI's NVIDIA packages (``nvidia/*/lib/libcufile.so.N``, which torch's
    and vLLM's wheels install off the loader's search path), so that the GDS backend, which
    looks for ``libcufile.so`` and then ``libcufile.so.0`` by name, finds it already loaded.
    Returns the path loaded, or None where no such package is installed (the GDS backend then
    looks on the usual path). ``nixl_agent.create_backend("GDS")`` calls it."""
    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "*", "lib", "libcufile.so.[0-9]*"))):
            ctypes.CDLL(path)
            return path
    return None
