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

Fenced reads (xfer grants). vLLM frees a prefill's held blocks when the decode's done
notification comes or the lease runs out (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``); with NIXL a
decode that reads later still gets bytes, from blocks that may already hold another prompt's KV.
Here a prefill worker's held blocks are readable only under a grant:

- every worker agent serves grants (xfer's side channel, ephemeral port on
  ``VLLM_NIXL_SIDE_CHANNEL_HOST``) and announces the address in the metadata vLLM's handshake
  carries (``pd_xfer.nixl``); ``kv_transfer_params`` are NIXL's, unchanged;
- when the worker learns that request R's blocks are held for sending (R enters its
  ``_reqs_to_send`` in ``start_load_kv``) it offers a grant named R;
- the decode's agent, when vLLM reads R's blocks (vLLM's notification names R), claims the grant
  for R over exactly the descriptors it reads (the first claimant binds it; with a cluster
  credential ``XFER_CLUSTER_SECRET_FILE`` the claim is authenticated) and reads under it;
- when the worker reports R done sending (done notification or lease expiry, in
  ``get_finished``/``get_transfer_results``) it revokes R's grant before it returns, so before
  vLLM puts the blocks back on its free list; revocation waits for reads still under it.

A read or claim after that fails with kind ``refused`` (``grant revoked or expired``), never
delivering bytes; vLLM's decode then treats R as a failed KV load (``kv_load_failure_policy``:
recompute, or fail the request). The prefill logs each revocation (logger ``vllm.pd_xfer``) with the
number of grants claimed under it. The fence relies on the decode asking for grants: it guards a
late read by a pd_xfer decode, not a hostile peer (region keys are in the metadata; the cluster
credential keeps strangers out). ``PD_XFER_KV_GRANTS=0`` turns fencing off on an engine; a
decode then reads a fenced prefill as before, and a fencing prefill serves an unfenced decode.
"""

from __future__ import annotations

import importlib
import logging
import os

from . import nixl

# A child of vLLM's logger, so that vLLM's log settings (level, format) apply to it.
logger = logging.getLogger("vllm.pd_xfer")

_UTILS = "vllm.distributed.nixl_utils"
_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"


def grants_enabled() -> bool:
    return os.environ.get("PD_XFER_KV_GRANTS", "1") != "0"


class FencingAgent(nixl.nixl_agent):
    """The agent vLLM's workers build: pd_xfer's ``nixl_agent`` serving grants."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if grants_enabled():
            host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "127.0.0.1"
            logger.info("pd_xfer agent %s serves grants on %s", self.name, self.serve_grants(host))


def install_agent() -> None:
    """Makes vLLM's NIXL connector build ``FencingAgent`` agents in this process."""
    utils = importlib.import_module(_UTILS)
    utils.NixlWrapper = FencingAgent
    utils.nixl_agent_config = nixl.nixl_agent_config
    utils.nixlXferTelemetry = nixl.nixlXferTelemetry
    worker = importlib.import_module(_WORKER)
    if not hasattr(worker, "NixlWrapper"):
        raise ImportError(f"{_WORKER} has no NixlWrapper: this vLLM is not the one pd_xfer.vllm was made for (0.32)")
    worker.NixlWrapper = FencingAgent
    worker.nixl_agent_config = nixl.nixl_agent_config


def vllm_agent_class() -> type:
    """The agent class vLLM's NIXL worker will construct now."""
    return importlib.import_module(_WORKER).NixlWrapper


install_agent()


class XferConnector(importlib.import_module(_CONNECTOR).NixlConnector):
    """vLLM's NixlConnector (pull mode) with xfer agents, its held blocks fenced by grants;
    see the module's documentation."""

    def _fencing_agent(self):
        worker = self.connector_worker
        agent = getattr(worker, "nixl_wrapper", None)
        if isinstance(agent, FencingAgent) and agent.grant_service is not None:
            return worker, agent
        return None, None

    def start_load_kv(self, forward_context, **kwargs) -> None:
        super().start_load_kv(forward_context, **kwargs)
        worker, agent = self._fencing_agent()
        if agent is not None:
            held = set(worker._reqs_to_send)
            for request_id in held - agent.offered_grants():
                agent.offer_grant(request_id)

    def _revoke_released(self) -> None:
        """Revokes the grants of requests whose blocks the worker no longer holds for sending,
        before vLLM learns they are done (and frees the blocks)."""
        worker, agent = self._fencing_agent()
        if agent is None:
            return
        for request_id in agent.offered_grants() - set(worker._reqs_to_send):
            revoked = agent.revoke_grant(request_id)
            if revoked is not None:
                claimed, claimant = revoked
                logger.info(
                    "pd_xfer revoked the grant for request %s (%d claimed by %s) before its blocks are freed",
                    request_id, claimed, claimant or "no reader",
                )

    def get_finished(self, finished_req_ids):
        finished = super().get_finished(finished_req_ids)
        self._revoke_released()
        return finished

    def get_transfer_results(self, finished_req_ids):
        results = super().get_transfer_results(finished_req_ids)
        self._revoke_released()
        return results


__all__ = ["FencingAgent", "XferConnector", "grants_enabled", "install_agent", "vllm_agent_class"]
