"""NIXL's Python agent, ``nixl._api.nixl_agent`` of NIXL 1.x, over pd_xfer.

The calls, argument forms and return values are NIXL's, so code written for NIXL (vLLM's
NixlConnector, SGLang's NIXL transfer backend, Dynamo) runs its transfers over xfer:

- descriptor lists from lists of ``(addr, len, dev_id[, meta])`` tuples, N×3 numpy arrays,
  torch tensors or lists of tensors (``get_reg_descs``, ``get_xfer_descs``);
- prepared lists and index-list transfers (``prep_xfer_dlist``, ``make_prepped_xfer``), or
  one-shot ones (``initialize_xfer``); ``transfer`` and ``check_xfer_state`` answer ``"DONE"``,
  ``"PROC"`` or ``"ERR"``; handles are truthy objects that release themselves when collected;
- ``get_new_notifs`` gives ``{sender name: [bytes, ...]}``, only what is new;
- ``add_remote_agent`` returns the peer's name as bytes; every call that takes a peer name
  takes bytes or str;
- errors are NIXL's exception classes (``nixlNotFoundError``, ``nixlInvalidParamError``, ...),
  which here are also ``pd_xfer.XferError`` and keep its ``kind``, with the reason in the
  message rather than only the status name.

Backend names are NIXL's (``"UCX"``, ``"POSIX"``, and xfer's own ``"TCP"``) or xfer's (``"ucx"``,
``"posix"``, ``"tcp"``). As with NIXL's POSIX plugin, file transfers name the agent itself as the
remote agent: ``prep_xfer_dlist(agent.name, file_descs, "FILE")`` with ``(offset, len, fd)`` rows,
or with ``(offset, len, devId)`` rows of files registered by path (``register_memory`` of
``(offset, len, devId, "rw,create:<path>")``, NIXL's path mode); ``query_memory`` answers a
file backend's ``stat`` of each descriptor's path. ``get_serialized_descs`` writes a list as
data (``pdxd1|`` and JSON, where NIXL pickles it), so ``deserialize_descs`` checks a peer's bytes
and never runs them.
The metadata blob is xfer's, not NIXL's: a NIXL agent and this one cannot be peers, and
``add_remote_agent`` says so when handed NIXL's metadata. NIXL methods this module does not
offer raise ``NotImplementedError`` naming the method.

Fenced reads (xfer grants; not in NIXL's API, used by ``pd_xfer.vllm``): an agent that called
``serve_grants(host)`` adds its grant service's address to its metadata, offers a grant per
request id with ``offer_grant(request_id)`` and revokes it with ``revoke_grant(request_id)``
before the memory is reused. A peer that loaded such metadata reads only under a grant: a
READ whose notification names a request id (``"<id>:..."``, as vLLM's are) first claims the
grant offered for that id, over the descriptors it reads, and runs under it; once revoked, the
claim or the read fails with kind ``refused`` (code ``grant revoked or expired``) and no byte
is delivered.
"""

from __future__ import annotations

import enum
import itertools
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from . import Agent, XferError, load_cufile, memory_type_of, regions

logger = logging.getLogger(__name__)

DEFAULT_COMM_PORT = 8888
# What NIXL callers pass as the agent name of a local descriptor list.
LOCAL_AGENT_NAMES = ("NIXL_INIT_AGENT", "")
# NIXL's backend names and the xfer backend each stands for.
BACKEND_NAMES = {"POSIX": "posix", "TCP": "tcp", "UCX": "ucx", "GDS": "gds"}
# What get_serialized_descs' bytes start with (a JSON body follows).
SERIALIZED_DESCS_PREFIX = b"pdxd1|"
# The xfer backends that move FILE memory and answer query_memory about files.
FILE_BACKENDS = frozenset({"posix", "gds"})
# The segment types each moves (TCP and POSIX stage GPU memory through host slots; UCX moves
# VRAM natively when its build has CUDA and stages it otherwise, as it stages local files).
BACKEND_MEM_TYPES = {
    "POSIX": ["DRAM_SEG", "FILE_SEG", "VRAM_SEG"],
    "TCP": ["DRAM_SEG", "FILE_SEG", "VRAM_SEG"],
    "UCX": ["DRAM_SEG", "FILE_SEG", "VRAM_SEG"],
    "GDS": ["FILE_SEG", "VRAM_SEG"],
}
# NIXL's per-backend thread-count parameters; xfer's backends size their own threads.
THREAD_PARAMS = ("num_threads", "thread_count", "num_cpus")
# The first bytes of NIXL's own metadata blobs (its serializer's tag).
NIXL_METADATA_PREFIX = b"nixlSerDes|"
# Metadata of an agent that serves grants: this prefix, its grant service's "host:port", "|",
# then xfer's metadata blob.
GRANT_METADATA_PREFIX = b"pdxg1|"
# How long an offered grant lives unless revoked first: a backstop, not the fence (vLLM's
# heartbeats may keep blocks held longer than any lease known when the grant is offered).
GRANT_TTL_S = 600.0


class nixlNotPostedError(XferError):
    pass


class nixlInvalidParamError(XferError):
    pass


class nixlBackendError(XferError):
    pass


class nixlNotFoundError(XferError):
    pass


class nixlMismatchError(XferError):
    pass


class nixlNotAllowedError(XferError):
    pass


class nixlRepostActiveError(XferError):
    pass


class nixlUnknownError(XferError):
    pass


class nixlNotSupportedError(XferError):
    pass


class nixlRemoteDisconnectError(XferError):
    pass


class nixlCancelledError(XferError):
    pass


class nixlNoTelemetryError(XferError):
    pass


# xfer's error kinds (xfer::XferError::kind) as NIXL's exception classes.
_ERROR_CLASSES = {
    "unknown_peer": nixlNotFoundError,
    "unknown_backend": nixlNotFoundError,
    "not_registered": nixlNotFoundError,
    "no_backend": nixlNotFoundError,
    "deregistered": nixlNotFoundError,
    "backend_exists": nixlInvalidParamError,
    "length_mismatch": nixlInvalidParamError,
    "invalid_argument": nixlInvalidParamError,
    "metadata": nixlMismatchError,
    "peer_disconnected": nixlRemoteDisconnectError,
    "cancelled": nixlCancelledError,
    "busy": nixlRepostActiveError,
    "not_posted": nixlNotPostedError,
}


def _nixl_error(cls: type[XferError], method: str, message: str, kind: str) -> XferError:
    error = cls(f"{method}: {message}")
    error.kind = kind
    return error


def _translate(error: XferError, method: str) -> XferError:
    kind = getattr(error, "kind", "backend")
    return _nixl_error(_ERROR_CLASSES.get(kind, nixlBackendError), method, str(error), kind)


def backend_params_env(backend: str) -> str:
    """The environment variable whose ``key=value,...`` settings every agent of this process
    gives a backend it creates (``PD_XFER_TCP_PARAMS``, ...), under ``create_backend``'s
    ``initParams``: vLLM creates its backends without settings, so this is how an operator turns
    on, e.g., the TCP backend's mutual TLS for KV transfers."""
    return f"PD_XFER_{backend.upper()}_PARAMS"


class _Translated:
    """``with _Translated("method"):`` re-raises xfer errors as NIXL's classes."""

    __slots__ = ("method",)

    def __init__(self, method: str):
        self.method = method

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        # Only xfer's own errors: NIXL classes raised inside are already translated.
        if type(error) is XferError:
            raise _translate(error, self.method) from error
        return False


def _peer_name(name: Any) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)


def _message(message: Any) -> bytes:
    return message.encode() if isinstance(message, str) else bytes(message)


def _indices(indices: Any) -> list[int]:
    # An integer array's tolist() is Python ints already (SGLang passes arrays of thousands of
    # block indices per transfer); anything else goes through int().
    if getattr(getattr(indices, "dtype", None), "kind", "") in ("i", "u"):
        return indices.tolist()
    if hasattr(indices, "tolist"):
        indices = indices.tolist()
    return [int(i) for i in indices]


class nixl_thread_sync_t(enum.Enum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT


def _plugin_list() -> list[str]:
    """NIXL's names of the backends this build of xfer offers."""
    return sorted(nixl for nixl, ours in BACKEND_NAMES.items() if ours in Agent.available_backends())


class nixlAgentConfig:
    """NIXL's binding-level agent settings (``nixl._bindings.nixlAgentConfig``), kept as given
    and used by nothing: callers that build a binding agent themselves (SGLang's HiCache NIXL
    storage sets ``syncMode`` this way) get the object they expect."""

    def __init__(
        self,
        useProgThread: bool = False,
        useListenThread: bool = False,
        listenPort: int = DEFAULT_COMM_PORT,
        syncMode: nixl_thread_sync_t = NIXL_THREAD_SYNC_NONE,
    ):
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.pthrDelay = 0
        self.lthrDelay = 100_000
        self.captureTelemetry = False


class nixlAgent:
    """NIXL's binding-level agent (``nixl._bindings.nixlAgent``) as far as ``getAvailPlugins``.
    A ``nixl_agent`` keeps its own xfer agent whatever its ``agent`` attribute is set to: code
    that swaps in a binding agent for its thread-sync mode (SGLang's HiCache NIXL storage)
    changes nothing, since xfer agents are always safe to share between threads."""

    def __init__(self, name: str, config: nixlAgentConfig | None = None):
        self.name = name
        self.config = config if config is not None else nixlAgentConfig()

    def getAvailPlugins(self) -> list[str]:
        return _plugin_list()


class nixl_agent_config:
    """NIXL's agent settings. xfer agents are always safe to share between threads, and their
    backends progress on their own, so ``enable_prog_thread``, ``num_threads`` and
    ``sync_mode`` are accepted and kept but change nothing."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] | None = None,
        sync_mode: nixl_thread_sync_t | None = None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.backends = ["UCX"] if backends is None else list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


class nixlXferTelemetry:
    """A finished transfer's figures, in NIXL's fields: microseconds and bytes. ``startTime`` is
    Unix time; ``descCount`` counts the request's descriptors as given (NIXL counts them after
    merging contiguous ones)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int, postDuration: int, xferDuration: int, totalBytes: int, descCount: int):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self.__slots__)
        return f"nixlXferTelemetry({fields})"


class _DescList:
    """A descriptor list and its memory type; ``owner`` keeps the described objects alive;
    ``metas`` are the registration tuples' fourth field, ``None`` where none was given (transfer
    lists, arrays, tensors: no list of empty strings is built for them)."""

    __slots__ = ("descs", "mem_type", "owner", "metas")

    def __init__(
        self, descs: list[tuple[int, int, int]], mem_type: str, owner: Any = None, metas: list[str] | None = None
    ):
        self.descs = descs
        self.mem_type = mem_type
        self.owner = owner
        self.metas = metas

    def meta_infos(self) -> list[str]:
        """Each descriptor's metaInfo, ``""`` where none was given."""
        return self.metas if self.metas is not None else [""] * len(self.descs)

    def descCount(self) -> int:
        return len(self.descs)

    def isEmpty(self) -> bool:
        return not self.descs

    def getType(self) -> str:
        return self.mem_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mem_type}, {len(self.descs)} descriptors)"


class nixlRegDList(_DescList):
    __slots__ = ()

    def trim(self) -> nixlXferDList:
        """The same descriptors without their metaInfo, as a transfer list (NIXL's ``trim``)."""
        return nixlXferDList(self.descs, self.mem_type, self.owner)


class nixlXferDList(_DescList):
    __slots__ = ()


_handle_ids = itertools.count(1)


class nixl_prepped_dlist_handle:
    """A prepared descriptor list. ``release()`` is idempotent; collection releases it too."""

    __slots__ = ("_id", "prepared", "local", "_released", "peer", "descs", "mem_type")

    def __init__(self, prepared: Any, local: bool, peer: str = "", dlist: _DescList | None = None):
        self._id = next(_handle_ids)
        self.prepared = prepared
        self.local = local
        self._released = False
        # A remote list's peer and descriptors: a read under a grant prepares its entries anew.
        self.peer = peer
        self.descs = dlist.descs if dlist is not None else []
        self.mem_type = dlist.mem_type if dlist is not None else ""

    def release(self):
        self._released = True
        self.prepared = None

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._id:x}, released={self._released})"


class nixl_xfer_handle:
    """A transfer request. ``release()`` is idempotent (an unfinished transfer is cancelled);
    collection releases it too."""

    __slots__ = ("_id", "request", "notif", "remake", "posted", "post_us", "_released", "__weakref__")

    def __init__(self, request: Any, notif: bytes, remake: Any):
        self._id = next(_handle_ids)
        self.request = request
        self.notif = notif
        # Builds the same request with another notification (transfer(handle, notif_msg=...)).
        self.remake = remake
        self.posted = False
        self.post_us = 0
        self._released = False

    def release(self):
        if not self._released:
            self._released = True
            request, self.request = self.request, None
            if request is not None:
                request.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            logger.debug("releasing a collected nixl_xfer_handle failed", exc_info=True)

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._id:x}, released={self._released})"


# NIXL agent methods that this module does not offer.
_UNSUPPORTED = frozenset(
    {
        "estimate_xfer_cost",
        "prep_mem_view",
        "release_mem_view",
        "get_partial_agent_metadata",
        "send_partial_agent_metadata",
        "get_remote_descs",
    }
)


class nixl_agent:
    """NIXL's ``nixl_agent(agent_name, nixl_conf=None, instantiate_all=False)`` over an xfer agent."""

    def __init__(self, agent_name: str, nixl_conf: nixl_agent_config | None = None, instantiate_all: bool = False):
        conf = nixl_conf or nixl_agent_config()
        with _Translated("nixl_agent"):
            self._agent = Agent(agent_name)
        self.name = agent_name
        self.plugin_list = self.get_plugin_list()
        if not self.plugin_list:
            raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
        # NIXL name -> xfer backend name, for the backends created.
        self.backends: dict[str, str] = {}
        self.notifs: dict[str, list[bytes]] = {}
        self._telemetry = conf.capture_telemetry
        self._lock = threading.Lock()
        # (mem_type, descriptors) -> registrations of exactly those descriptors, each with the
        # files it opened by path.
        self._registrations: dict[tuple[str, tuple], list[tuple[Any, _PathModeFiles]]] = {}
        # devId -> open file descriptor, of FILE descriptors registered by path.
        self._path_mode_fds: dict[int, int] = {}
        # Fenced reads: our grant service's address, peers' ones, our open offers by name.
        self.grant_service: str | None = None
        self._peer_grant_services: dict[str, str] = {}
        self._offers: dict[str, Any] = {}
        self.grants_offered = 0
        self.grants_revoked = 0
        wanted = self.plugin_list if instantiate_all else conf.backends
        for backend in wanted:
            if backend.upper() not in self.plugin_list:
                logger.warning("backend %s is not available (xfer offers %s); skipped", backend, self.plugin_list)
                continue
            self.create_backend(backend)
        if conf.enable_listen:
            with _Translated("nixl_agent"):
                self._agent.start_side_channel(f"0.0.0.0:{conf.port}")

    def __getattr__(self, name: str):
        if name in _UNSUPPORTED:
            def unsupported(*_args, **_kwargs):
                raise NotImplementedError(f"pd_xfer.nixl.nixl_agent does not support NIXL's {name}()")

            return unsupported
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # Backends.

    def get_plugin_list(self) -> list[str]:
        return _plugin_list()

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        return list(BACKEND_MEM_TYPES.get(backend.upper(), []))

    def get_backend_mem_types(self, backend: str) -> list[str]:
        return self.get_plugin_mem_types(backend)

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        return {}

    def get_backend_params(self, backend: str) -> dict[str, str]:
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] | None = None):
        ours = BACKEND_NAMES.get(backend.upper())
        if ours is None or ours not in Agent.available_backends():
            raise _nixl_error(
                nixlNotFoundError, "create_backend", f"no backend {backend!r} (available: {self.plugin_list})",
                "unknown_backend",
            )
        if backend.upper() in self.backends:
            raise _nixl_error(
                nixlInvalidParamError, "create_backend", f"backend {backend!r} already created", "backend_exists"
            )
        params = {k: str(v) for k, v in (initParams or {}).items() if k not in THREAD_PARAMS}
        if ours == "gds":
            load_cufile()
        with _Translated("create_backend"):
            ignored = self._agent.add_backend(ours, params, params_env=backend_params_env(backend), ignore_unknown=True)
        if ignored:
            # NIXL passes its plugins' settings through and ignores what a plugin does not take;
            # callers written for it send such keys (SGLang's HiCache storage sends "active").
            logger.warning(
                "backend %s: initParams %s are not settings of xfer's %s backend; ignored, as NIXL ignores them",
                backend, sorted(ignored), ours,
            )
        self.backends[backend.upper()] = ours

    def _request_backend(self, backends: list[str] | None) -> str | None:
        if not backends:
            return None
        first = backends[0].upper()
        if first not in self.backends:
            raise KeyError(backends[0])
        return self.backends[first]

    # Registration.

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> nixlRegDList:
        tuples, kind, owner = self._descs(descs, mem_type, "get_reg_descs")
        return nixlRegDList(tuples, kind, owner, _metas(descs, len(tuples)))

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> nixlXferDList:
        return nixlXferDList(*self._descs(descs, mem_type, "get_xfer_descs"))

    def _descs(self, descs: Any, mem_type: str | None, method: str):
        with _Translated(method):
            if _is_integer_table(descs) and descs.shape[1] not in (3, 4):
                raise _nixl_error(
                    nixlInvalidParamError, method,
                    f"a descriptor array has 3 columns (addr, len, devId), not {descs.shape[1]}", "invalid_argument",
                )
            tuples = regions(descs)
            kind = mem_type or memory_type_of(descs, default="")
            if not kind:
                raise _nixl_error(nixlInvalidParamError, method, "a memory type is needed (DRAM, VRAM, ...)", "invalid_argument")
            if not tuples:
                raise _nixl_error(nixlInvalidParamError, method, "the descriptor list is empty", "invalid_argument")
            return tuples, _mem_type_name(kind), descs

    def get_serialized_descs(self, descs: _DescList) -> bytes:
        """``descs`` as bytes to send to a peer (NIXL pickles its lists; these bytes are data
        only, so a peer's bytes are checked, never run)."""
        if not isinstance(descs, _DescList):
            raise _nixl_error(
                nixlInvalidParamError, "get_serialized_descs", f"not a descriptor list: {type(descs).__name__}",
                "invalid_argument",
            )
        body = {"kind": "reg" if isinstance(descs, nixlRegDList) else "xfer", "mem_type": descs.mem_type,
                "descs": [list(desc) for desc in descs.descs]}
        if isinstance(descs, nixlRegDList):
            body["metas"] = descs.meta_infos()
        return SERIALIZED_DESCS_PREFIX + json.dumps(body, separators=(",", ":")).encode()

    def deserialize_descs(self, serialized_descs: bytes) -> _DescList:
        """The list ``get_serialized_descs`` made; malformed bytes raise nixlInvalidParamError."""
        return _deserialized(bytes(serialized_descs))

    def register_memory(self, reg_list: Any, mem_type: str | None = None, backends: list[str] | None = None) -> nixlRegDList:
        """As NIXL's. FILE descriptors whose metaInfo is ``"<ro|rw>[,create][,direct]:<path>"``
        (NIXL's path mode) name the file by path: it is opened here (created with ``create``,
        O_DIRECT with ``direct``) and closed at deregistration, and transfer lists name it by the
        descriptor's devId. Other FILE descriptors carry an open file descriptor as devId."""
        dlist = reg_list if isinstance(reg_list, nixlRegDList) else self.get_reg_descs(reg_list, mem_type)
        for backend in backends or []:
            if backend.upper() not in self.backends:
                raise KeyError(backend)
        opened = self._open_path_mode(dlist) if dlist.mem_type == "FILE" else _PathModeFiles()
        try:
            with _Translated("register_memory"):
                # The files close once the registration is gone, deregistered or collected.
                registration = self._agent.register_memory(
                    _with_fds(dlist.descs, opened.fds), dlist.mem_type, keep_alive=(dlist.owner, opened)
                )
        except BaseException:
            self._close_path_mode(opened)
            raise
        with self._lock:
            self._registrations.setdefault((dlist.mem_type, tuple(dlist.descs)), []).append((registration, opened))
        return dlist

    def deregister_memory(self, dereg_list: Any, backends: list[str] | None = None):
        dlist = dereg_list if isinstance(dereg_list, nixlRegDList) else self.get_reg_descs(dereg_list)
        key = (dlist.mem_type, tuple(dlist.descs))
        with self._lock:
            registrations = self._registrations.get(key)
            entry = registrations.pop() if registrations else None
            if registrations == []:
                del self._registrations[key]
        if entry is None:
            raise _nixl_error(nixlNotFoundError, "deregister_memory", "these descriptors are not registered", "not_registered")
        registration, opened = entry
        try:
            registration.deregister()
        finally:
            self._close_path_mode(opened)

    def _open_path_mode(self, dlist: _DescList) -> _PathModeFiles:
        """Opens the files that ``dlist``'s path-mode descriptors name, and maps their devIds to
        the descriptors opened (all or none: a failure closes those already opened)."""
        opened = _PathModeFiles()
        try:
            for (_, _, dev_id), meta in zip(dlist.descs, dlist.meta_infos()):
                mode = _path_mode(meta)
                if mode is None:
                    continue
                if dev_id in opened.fds:
                    raise _devid_taken(dev_id)
                flags, path = mode
                try:
                    opened.fds[dev_id] = os.open(path, flags, 0o644)
                except OSError as error:
                    raise _nixl_error(
                        nixlBackendError, "register_memory", f"cannot open {path!r} ({meta!r}): {error.strerror}",
                        "backend",
                    ) from error
            # Checked and claimed at once: two registrations may race for a devId.
            with self._lock:
                taken = next((dev_id for dev_id in opened.fds if dev_id in self._path_mode_fds), None)
                if taken is None:
                    self._path_mode_fds.update(opened.fds)
            if taken is not None:
                raise _devid_taken(taken)
        except BaseException:
            opened.close()
            raise
        return opened

    def _close_path_mode(self, opened: _PathModeFiles):
        with self._lock:
            for dev_id in opened.fds:
                self._path_mode_fds.pop(dev_id, None)
        opened.close()

    def _wire(self, dlist: _DescList) -> list[tuple[int, int, int]]:
        """``dlist``'s descriptors as the native agent takes them: FILE devIds of files
        registered by path become their open descriptors."""
        if dlist.mem_type != "FILE":
            return dlist.descs
        with self._lock:
            fds = dict(self._path_mode_fds)
        return _with_fds(dlist.descs, fds)

    def query_memory(self, reg_list: Any, backend: str, mem_type: str | None = None) -> list[dict[str, str] | None]:
        """As NIXL's: for a file backend (POSIX, GDS), each descriptor's metaInfo is a path, and
        its answer is ``{"mtime", "mode", "size"}`` (decimal strings, from ``stat``), or ``None``
        where nothing is found there; other backends raise ``nixlNotSupportedError``."""
        dlist = reg_list if isinstance(reg_list, nixlRegDList) else self.get_reg_descs(reg_list, mem_type)
        ours = self.backends.get(backend.upper())
        if ours is None:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends)}")
        if ours not in FILE_BACKENDS:
            raise _nixl_error(
                nixlNotSupportedError, "query_memory",
                f"backend {backend!r} answers no queries (the file backends do: {sorted(FILE_BACKENDS)})",
                "unsupported",
            )
        return [_file_info(meta) for meta in dlist.meta_infos()]

    # Metadata and peers.

    def get_agent_metadata(self) -> bytes:
        if not self.backends:
            raise _nixl_error(nixlInvalidParamError, "get_agent_metadata", "no backend created", "no_backend")
        blob = self._agent.local_metadata()
        if self.grant_service is not None:
            return GRANT_METADATA_PREFIX + self.grant_service.encode() + b"|" + blob
        return blob

    def add_remote_agent(self, metadata: bytes) -> bytes:
        metadata = bytes(metadata)
        if metadata.startswith(NIXL_METADATA_PREFIX):
            raise _nixl_error(
                nixlMismatchError,
                "add_remote_agent",
                "the peer's metadata is NIXL's own (it starts with b'nixlSerDes|'), not pd_xfer's: the peer runs "
                "NIXL. Both sides of a pair must use the same transfer library (XferConnector on both engines, "
                "or NixlConnector on both)",
                "metadata",
            )
        grant_service = None
        if metadata.startswith(GRANT_METADATA_PREFIX):
            address, sep, metadata = metadata[len(GRANT_METADATA_PREFIX):].partition(b"|")
            if not sep:
                raise _nixl_error(
                    nixlInvalidParamError, "add_remote_agent", "grant-service metadata without its address",
                    "invalid_argument",
                )
            grant_service = address.decode("ascii", "replace")
        with _Translated("add_remote_agent"):
            name = self._agent.load_remote_metadata(metadata)
        if name == self.name:
            self._agent.invalidate_remote(name)
            raise _nixl_error(nixlInvalidParamError, "add_remote_agent", "the metadata is this agent's own", "invalid_argument")
        with self._lock:
            if grant_service is None:
                self._peer_grant_services.pop(name, None)
            else:
                self._peer_grant_services[name] = grant_service
        return name.encode()

    # Fenced reads (see the module's documentation).

    def serve_grants(self, host: str = "127.0.0.1") -> str:
        """Starts this agent's grant service (xfer's side channel) on an ephemeral port of
        ``host`` and announces it in the metadata; returns its ``host:port``."""
        with _Translated("serve_grants"):
            bound_host, port = self._agent.start_side_channel(f"{host}:0")
        self.grant_service = f"{bound_host}:{port}"
        return self.grant_service

    def offer_grant(self, name: str, ttl: float = GRANT_TTL_S):
        """Offers a grant under ``name`` (a request id) for its reader to claim; a name already
        offered keeps its offer."""
        with self._lock:
            if name in self._offers:
                return
            with _Translated("offer_grant"):
                self._offers[name] = self._agent.offer_grant(name, ttl)
            self.grants_offered += 1

    def offered_grants(self) -> set[str]:
        with self._lock:
            return set(self._offers)

    def revoke_grant(self, name: str) -> tuple[int, str | None] | None:
        """Revokes the grant offered under ``name``; returns once no read under it still touches
        the memory: ``(grants claimed, claimant)``, or ``None`` when none was offered."""
        with self._lock:
            offer = self._offers.pop(name, None)
        if offer is None:
            return None
        claimant = offer.claimant
        claimed = offer.revoke()
        with self._lock:
            self.grants_revoked += 1
        return claimed, claimant

    def _claim_for(self, notif: bytes, remote: nixl_prepped_dlist_handle, indices: list[int]):
        """A READ from a peer that serves grants: claims the grant offered for the request id
        its notification names, over exactly the descriptors read, and prepares them under it.
        Returns the prepared list and its indices, or ``None`` for a peer without grants."""
        service = self._peer_grant_services.get(remote.peer)
        if service is None:
            return None
        request_id = notif.decode("utf-8", "replace").rpartition(":")[0]
        if not request_id:
            raise _nixl_error(
                nixlInvalidParamError, "make_prepped_xfer",
                f"a read from {remote.peer} (which fences reads by grant) needs a notification naming its request",
                "invalid_argument",
            )
        descs = [remote.descs[i] for i in indices]
        with _Translated("make_prepped_xfer"), self._lock:
            # Loading a grant and preparing under it, atomically: a concurrent load of another
            # grant over the same descriptors must not slip in between.
            self._agent.claim_grant(service, request_id, descs, remote.mem_type)
            prepared = self._agent.prep_remote(remote.peer, descs, remote.mem_type)
        return prepared, list(range(len(descs)))

    def remove_remote_agent(self, agent: Any):
        name = _peer_name(agent)
        with self._lock:
            self._peer_grant_services.pop(name, None)
        if name in self._agent.peers():
            with _Translated("remove_remote_agent"):
                self._agent.invalidate_remote(name)

    def check_remote_metadata(self, remote_name: Any, descs: Any = None) -> bool:
        name = _peer_name(remote_name)
        if name == self.name:
            return True
        if name not in self._agent.peers():
            return False
        if descs is None:
            return True
        tuples, kind, _ = self._descs(descs, None if isinstance(descs, _DescList) else "DRAM", "check_remote_metadata")
        try:
            self._agent.prep_remote(name, tuples, kind)
        except XferError:
            return False
        return True

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        with _Translated("send_local_metadata"):
            self._agent.send_local_metadata(f"{ip_addr or '127.0.0.1'}:{port}")

    def fetch_remote_metadata(self, remote_name: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        with _Translated("fetch_remote_metadata"):
            self._agent.fetch_remote_metadata(f"{ip_addr or '127.0.0.1'}:{port}")

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT):
        with _Translated("invalidate_local_metadata"):
            self._agent.invalidate_local_metadata(f"{ip_addr or '127.0.0.1'}:{port}")

    # Prepared lists and transfers.

    def prep_xfer_dlist(
        self, agent_name: Any, xfer_list: Any, mem_type: str | None = None, backends: list[str] | None = None
    ) -> nixl_prepped_dlist_handle:
        if _is_integer_table(xfer_list) and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("prep_xfer_dlist: strided (N×5) descriptors need a memory type")
            xfer_list = _expand_strided(xfer_list)
        dlist = xfer_list if isinstance(xfer_list, _DescList) else self.get_xfer_descs(xfer_list, mem_type)
        name = _peer_name(agent_name)
        with _Translated("prep_xfer_dlist"):
            if name in LOCAL_AGENT_NAMES:
                return nixl_prepped_dlist_handle(self._agent.prep_local(self._wire(dlist), dlist.mem_type), local=True)
            # Through the published regions: a list kept across requests must not carry the key of
            # a grant loaded meanwhile, which its peer revokes (reads under grants go through
            # `_claim_for`).
            prepared = self._agent.prep_remote_published(name, self._wire(dlist), dlist.mem_type)
            return nixl_prepped_dlist_handle(prepared, local=False, peer=name, dlist=dlist)

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle):
        handle.release()

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Any,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: list[str] | None = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        op = _operation(operation)
        for side, want_local in ((local_xfer_side, True), (remote_xfer_side, False)):
            if side._released or side.prepared is None:
                raise _nixl_error(nixlInvalidParamError, "make_prepped_xfer", f"{side!r} was released", "invalid_argument")
            if side.local != want_local:
                which = "local" if want_local else "remote"
                raise _nixl_error(
                    nixlInvalidParamError, "make_prepped_xfer", f"{side!r} is not a {which} list", "invalid_argument"
                )
        local, remote = _indices(local_indices), _indices(remote_indices)
        if len(local) != len(remote) or not local:
            raise _nixl_error(
                nixlInvalidParamError,
                "make_prepped_xfer",
                f"{len(local)} local and {len(remote)} remote indices (need the same number, at least one)",
                "invalid_argument",
            )
        remote_side = (remote_xfer_side.prepared, remote)
        if op == "READ":
            remote_side = self._claim_for(_message(notif_msg), remote_xfer_side, remote) or remote_side
        return self._handle(
            "make_prepped_xfer", op, (local_xfer_side.prepared, local), remote_side,
            notif_msg, self._request_backend(backends),
        )

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: Any,
        notif_msg: bytes = b"",
        backends: list[str] | None = None,
    ) -> nixl_xfer_handle:
        op = _operation(operation)
        local_list = local_descs if isinstance(local_descs, _DescList) else self.get_xfer_descs(local_descs)
        remote_list = remote_descs if isinstance(remote_descs, _DescList) else self.get_xfer_descs(remote_descs)
        if local_list.descCount() != remote_list.descCount():
            raise _nixl_error(
                nixlInvalidParamError,
                "initialize_xfer",
                f"{local_list.descCount()} local and {remote_list.descCount()} remote descriptors",
                "invalid_argument",
            )
        backend = self._request_backend(backends)
        with _Translated("initialize_xfer"):
            prepared_local = self._agent.prep_local(self._wire(local_list), local_list.mem_type)
            prepared_remote = self._agent.prep_remote(
                _peer_name(remote_agent), self._wire(remote_list), remote_list.mem_type
            )
        every = list(range(local_list.descCount()))
        return self._handle("initialize_xfer", op, (prepared_local, every), (prepared_remote, every), notif_msg, backend)

    def _handle(self, method: str, op: str, local: tuple, remote: tuple, notif_msg: Any, backend: str | None):
        """A transfer handle over prepared lists and index lists; it can rebuild its request
        with another notification (``transfer(handle, notif_msg=...)``)."""

        def remake(notif: bytes):
            with _Translated(method):
                return self._agent.make_request(op, local[0], local[1], remote[0], remote[1], notif or None, backend)

        notif = _message(notif_msg)
        return nixl_xfer_handle(remake(notif), notif, remake)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        request = _live(handle, "transfer")
        notif = _message(notif_msg)
        if notif and notif != handle.notif:
            if handle.posted and not _finished(request):
                raise _nixl_error(nixlRepostActiveError, "transfer", "the transfer is still in progress", "busy")
            request.release()
            handle.request, handle.notif = handle.remake(notif), notif
            request = handle.request
        started = time.monotonic()
        with _Translated("transfer"):
            request.post()
        handle.post_us = int((time.monotonic() - started) * 1e6)
        handle.posted = True
        return self.check_xfer_state(handle)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        request = _live(handle, "check_xfer_state")
        if not handle.posted:
            raise _nixl_error(nixlNotPostedError, "check_xfer_state", "the transfer was never posted", "not_posted")
        try:
            return "DONE" if request.poll() else "PROC"
        except XferError as error:
            logger.warning("transfer %r failed: %s", handle, error)
            return "ERR"

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        backend = _live(handle, "query_xfer_backend").backend
        return next((nixl for nixl, ours in BACKEND_NAMES.items() if ours == backend), backend.upper())

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        request = _live(handle, "get_xfer_telemetry")
        telemetry = request.telemetry() if self._telemetry else None
        if telemetry is None:
            reason = "telemetry capture is off (nixl_agent_config(capture_telemetry=True))" if not self._telemetry else (
                "the transfer was never posted"
            )
            raise _nixl_error(nixlNoTelemetryError, "get_xfer_telemetry", reason, "invalid_argument")
        return nixlXferTelemetry(
            startTime=telemetry["posted_at_us"],
            postDuration=handle.post_us,
            xferDuration=telemetry["duration_us"] or 0,
            totalBytes=telemetry["bytes"],
            descCount=telemetry["descriptors"],
        )

    def release_xfer_handle(self, handle: nixl_xfer_handle):
        handle.release()

    # Notifications.

    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        return {name: messages for name, messages in self._agent.get_notifs().items() if messages}

    def update_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        for name, messages in self.get_new_notifs().items():
            self.notifs.setdefault(name, []).extend(messages)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: Any, lookup_tag: bytes, tag_is_prefix: bool = True) -> bool:
        self.update_notifs()
        messages = self.notifs.get(_peer_name(remote_agent_name), [])
        for i, message in enumerate(messages):
            if message.startswith(lookup_tag) if tag_is_prefix else message == lookup_tag:
                del messages[i]
                return True
        return False

    def make_connection(self, remote_agent: Any, backends: list[str] | None = None):
        """As NIXL's: opens now what the first transfer to ``remote_agent`` would open, through
        every backend or only ``backends`` (TCP: one connection per stream through TLS,
        hello and authentication, which the first requests then use; QUIC: its connection; UCX:
        its endpoint, wired up by a flush). A peer that cannot be reached or
        refuses this agent raises here."""
        name = _peer_name(remote_agent)
        chosen = [self.backends[backend.upper()] for backend in backends or []] or [None]
        with _Translated("make_connection"):
            for backend in chosen:
                self._agent.make_connection(name, backend)

    def send_notif(self, remote_agent_name: Any, notif_msg: bytes, backend: str | None = None):
        with _Translated("send_notif"):
            self._agent.send_notif(_peer_name(remote_agent_name), _message(notif_msg))


# NIXL's ``nixl._api`` reaches its bindings module as ``nixlBind``; here both are this module
# (install_as_nixl maps ``nixl._bindings`` to it too).
nixlBind = sys.modules[__name__]


def install_as_nixl() -> None:
    """Makes ``import nixl._api`` and ``import nixl._bindings`` give this module, in this
    process: for code that imports NIXL by name with no way to pass another agent class
    (SGLang's NIXL transfer backend imports ``nixl._api`` when it builds its manager, and the
    exception classes from ``nixl._bindings``). Call it before that code imports NIXL; a NIXL
    already imported in this process is replaced for later imports only."""
    import types

    this = sys.modules[__name__]
    package = types.ModuleType("nixl")
    package.__doc__ = "pd_xfer.nixl standing in for NIXL (pd_xfer.nixl.install_as_nixl)"
    package.__path__ = []
    package._api = this
    package._bindings = this
    sys.modules["nixl"] = package
    sys.modules["nixl._api"] = this
    sys.modules["nixl._bindings"] = this


def _is_integer_table(obj: Any) -> bool:
    """A two-dimensional integer array (numpy's or any with its shape and dtype)."""
    shape = getattr(obj, "shape", None)
    kind = getattr(getattr(obj, "dtype", None), "kind", "")
    return shape is not None and len(shape) == 2 and kind in ("i", "u")


# A strided list expands to one descriptor per block; more than this is refused rather than
# built (16 M descriptors is a few GB of Python tuples).
MAX_STRIDED_DESCS = 1 << 24


def _expand_strided(rows: Any) -> list[tuple[int, int, int]]:
    """NIXL's strided (compressed) descriptor rows ``(addr, len, devId, stride, count)``, each
    ``count`` blocks of ``len`` bytes ``stride`` apart from ``addr``, as one descriptor per
    block, rows in order (a prepared list's indices count blocks)."""
    out: list[tuple[int, int, int]] = []
    for addr, length, dev_id, stride, count in rows.tolist():
        if min(addr, length, dev_id, stride, count) < 0:
            raise _nixl_error(
                nixlInvalidParamError, "prep_xfer_dlist", f"a strided row has a negative field: "
                f"{(addr, length, dev_id, stride, count)}", "invalid_argument",
            )
        if len(out) + count > MAX_STRIDED_DESCS:
            raise _nixl_error(
                nixlInvalidParamError, "prep_xfer_dlist", f"strided rows expand to more than "
                f"{MAX_STRIDED_DESCS} descriptors", "invalid_argument",
            )
        out.extend((addr + i * stride, length, dev_id) for i in range(count))
    return out


def _operation(operation: str) -> str:
    if operation not in ("READ", "WRITE"):
        raise KeyError(operation)
    return operation


def _mem_type_name(kind: str) -> str:
    """NIXL's memory type names (and its aliases ``cpu``, ``cuda``, ``BLOCK``) as xfer's; NIXL
    raises KeyError for any other."""
    name = {"CPU": "DRAM", "CUDA": "VRAM", "BLOCK": "BLK"}.get(kind.upper(), kind.upper())
    if name not in ("DRAM", "VRAM", "FILE", "BLK", "OBJ"):
        raise KeyError(kind)
    return name


def _deserialized(data: bytes) -> _DescList:
    def bad(reason: str) -> XferError:
        return _nixl_error(nixlInvalidParamError, "deserialize_descs", reason, "invalid_argument")

    if not data.startswith(SERIALIZED_DESCS_PREFIX):
        hint = " (NIXL's own, pickled: pd_xfer and NIXL agents cannot be peers)" if data[:1] == b"\x80" else ""
        raise bad(f"not a descriptor list from get_serialized_descs{hint}")
    try:
        body = json.loads(data[len(SERIALIZED_DESCS_PREFIX):])
    except (ValueError, RecursionError) as error:
        # Not UTF-8, not JSON, an integer past Python's digit limit, or nested too deep.
        raise bad(f"malformed: {error}") from None
    if not isinstance(body, dict) or set(body) - {"kind", "mem_type", "descs", "metas"}:
        raise bad("malformed: expected kind, mem_type, descs (and metas)")
    kind, descs, metas = body.get("kind"), body.get("descs"), body.get("metas")
    if kind not in ("reg", "xfer") or not isinstance(descs, list) or not descs:
        raise bad("malformed: kind must be reg or xfer, descs a non-empty list")
    try:
        mem_type = _mem_type_name(str(body.get("mem_type")))
    except KeyError:
        raise bad(f"unknown memory type {body.get('mem_type')!r}") from None
    limit = 1 << 64
    rows = []
    for desc in descs:
        fields = desc if isinstance(desc, list) and len(desc) == 3 else None
        if fields is None or not all(type(v) is int and 0 <= v < limit for v in fields):
            raise bad(f"malformed descriptor {desc!r}: expected [addr, len, devId] of unsigned 64-bit integers")
        rows.append((fields[0], fields[1], fields[2]))
    if kind == "xfer":
        if metas is not None:
            raise bad("malformed: a transfer list carries no metaInfo")
        return nixlXferDList(rows, mem_type)
    if metas is None:
        metas = [""] * len(rows)
    if not isinstance(metas, list) or len(metas) != len(rows) or not all(isinstance(m, str) for m in metas):
        raise bad("malformed: metas must be one string per descriptor")
    return nixlRegDList(rows, mem_type, None, metas)


def _metas(descs: Any, count: int) -> list[str] | None:
    """The metaInfo of NIXL registration tuples ``(addr, len, devId, metaInfo)`` (``""`` for a
    row without one), or ``None`` when no row carries one."""
    if isinstance(descs, _DescList):
        return descs.metas
    rows = [descs] if isinstance(descs, tuple) and descs and isinstance(descs[0], int) else descs
    if isinstance(rows, (list, tuple)) and len(rows) == count and any(map(_has_meta, rows)):
        return [str(row[3]) if _has_meta(row) else "" for row in rows]
    return None


def _has_meta(row: Any) -> bool:
    return isinstance(row, (tuple, list)) and len(row) == 4


def _path_mode(meta: str) -> tuple[int, str] | None:
    """The ``os.open`` flags and path of a FILE descriptor registered by path (NIXL's path mode,
    ``"<ro|rw>[,create][,direct]:<path>"``, split at the first colon), or ``None`` for a
    metaInfo of any other form (its devId is then an open file descriptor)."""
    spec, sep, path = meta.partition(":")
    if not sep or not path:
        return None
    access, *options = spec.split(",")
    flags = {"ro": os.O_RDONLY, "rw": os.O_RDWR}.get(access)
    if flags is None or any(option not in ("create", "direct") for option in options):
        return None
    if "create" in options:
        flags |= os.O_CREAT
    if "direct" in options:
        flags |= getattr(os, "O_DIRECT", 0)
    return flags | os.O_CLOEXEC, path


def _file_info(path: str) -> dict[str, str] | None:
    """What a file backend answers ``query_memory`` about ``path``: NIXL's fields, or ``None``
    where ``stat`` finds nothing."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return {"mtime": str(int(st.st_mtime)), "mode": str(st.st_mode), "size": str(st.st_size)}


def _with_fds(descs: list[tuple[int, int, int]], fds: dict[int, int]) -> list[tuple[int, int, int]]:
    """``descs`` with the devIds of files registered by path replaced by their descriptors."""
    if not fds:
        return descs
    return [(addr, length, fds.get(dev_id, dev_id)) for addr, length, dev_id in descs]


class _PathModeFiles:
    """The files a registration opened by path: devId -> open file descriptor."""

    __slots__ = ("fds",)

    def __init__(self, fds: dict[int, int] | None = None):
        self.fds = fds if fds is not None else {}

    def close(self):
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                logger.debug("closing a file registered by path failed", exc_info=True)

    def __del__(self):
        # Held by the native registration, which lets go only once no transfer uses the files.
        self.close()


def _devid_taken(dev_id: int) -> XferError:
    return _nixl_error(
        nixlInvalidParamError, "register_memory", f"devId {dev_id} already names a file registered by path",
        "invalid_argument",
    )


def _live(handle: nixl_xfer_handle, method: str):
    if not isinstance(handle, nixl_xfer_handle):
        raise _nixl_error(nixlInvalidParamError, method, f"not a transfer handle: {handle!r}", "invalid_argument")
    if handle._released or handle.request is None:
        raise _nixl_error(nixlInvalidParamError, method, f"{handle!r} was released", "invalid_argument")
    return handle.request


def _finished(request: Any) -> bool:
    try:
        return request.poll()
    except XferError:
        return True
