"""A vLLM KV connector that moves KV blocks over xfer: ``XferConnector``.

Start both engines of a pair with

    --kv-transfer-config '{"kv_connector": "XferConnector",
                           "kv_connector_module_path": "pd_xfer.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"backends": ["TCP"]}}'

It is vLLM's own NixlConnector, unchanged: the same ``kv_transfer_params``, handshake over its
ZMQ side channel, done notifications, heartbeats and lease, so routers and our sidecar treat it
as NixlConnector. The only difference is the transfer agent: ``pd_xfer.nixl.nixl_agent``
instead of NIXL's. ``backends`` are NIXL-style names: ``"TCP"`` or ``"UCX"`` (vLLM's default).

vLLM has no option to choose the agent class. Its NIXL worker reads the module-level name
``NixlWrapper`` (and ``nixl_agent_config``) when it builds the agent; vLLM resolves both lazily
in ``vllm.distributed.nixl_utils``. Importing this module binds them to pd_xfer's classes, in
``nixl_utils`` and in the NIXL worker module: the one place vLLM is touched
(``install_agent``, checked against the installed vLLM by ``vllm_agent_class``). vLLM imports
this module in every process that builds the connector (scheduler and workers) before it builds
it, so every agent of such an engine is an xfer agent. A pair where one engine runs
NixlConnector and the other XferConnector fails at the handshake (``add_remote_agent`` refuses
the other library's metadata), never with corrupt KV.
"""

from __future__ import annotations

import importlib

from . import nixl

_UTILS = "vllm.distributed.nixl_utils"
_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"


def install_agent() -> None:
    """Makes vLLM's NIXL connector build ``pd_xfer.nixl.nixl_agent`` agents in this process."""
    utils = importlib.import_module(_UTILS)
    utils.NixlWrapper = nixl.nixl_agent
    utils.nixl_agent_config = nixl.nixl_agent_config
    utils.nixlXferTelemetry = nixl.nixlXferTelemetry
    worker = importlib.import_module(_WORKER)
    if not hasattr(worker, "NixlWrapper"):
        raise ImportError(f"{_WORKER} has no NixlWrapper: this vLLM is not the one pd_xfer.vllm was made for (0.32)")
    worker.NixlWrapper = nixl.nixl_agent
    worker.nixl_agent_config = nixl.nixl_agent_config


def vllm_agent_class() -> type:
    """The agent class vLLM's NIXL worker will construct now."""
    return importlib.import_module(_WORKER).NixlWrapper


install_agent()


class XferConnector(importlib.import_module(_CONNECTOR).NixlConnector):
    """vLLM's NixlConnector (pull mode) with xfer agents; see the module's documentation."""


__all__ = ["XferConnector", "install_agent", "vllm_agent_class"]
