"""Starts `sglang.launch_server` with the adjustments SGLang's CPU engine needs for P/D.

    python ci/sglang/launch.py --model-path DIR ...   # the arguments of sglang.launch_server

Mooncake's sender declares `supports_host_tensor_indices = True`, which makes the prefill ask
torch for pinned CUDA host memory in `_send_kv_chunk` and crash on a machine without CUDA. With
the attribute False the sender takes its plain numpy path (../../shared/SGLANG_CPU.md, item 2).

With `PD_SGLANG_NIXL=pd_xfer` (engine.sh --transfer xfer), SGLang's NIXL transfer backend runs
over xfer: `pd_xfer.nixl` is installed as `nixl`, which that backend imports by name. Its manager
labels every KV buffer VRAM whatever the device; the CPU engine's (`SGLANG_USE_CPU_ENGINE=1`,
which engine.sh sets) are host memory, so there the agent SGLang gets registers and transfers
VRAM-labelled lists as DRAM. Anywhere else VRAM stays VRAM.

The adjustments are made at start-up, never in an edited copy of SGLang. SGLang starts its
scheduler in `spawn`ed processes; those run the main module's top level again (as
`__mp_main__`). This file stays the main module (runpy without `alter_sys`), so the adjustments
apply in every process, while only the first process runs the server; each says so on stderr.
This directory also holds our `sgl_kernel` stand-in and is on `sys.path` first.
"""

import os
import runpy
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _install_pd_xfer_as_nixl():
    import pd_xfer.nixl

    def host(mem_type):
        return "DRAM" if isinstance(mem_type, str) and mem_type.upper() in ("VRAM", "CUDA") else mem_type

    class HostKvAgent(pd_xfer.nixl.nixl_agent):
        """The agent SGLang builds: VRAM-labelled lists are the CPU engine's host memory."""

        def register_memory(self, reg_list, mem_type=None, backends=None):
            return super().register_memory(reg_list, host(mem_type), backends)

        def get_reg_descs(self, descs, mem_type=None):
            return super().get_reg_descs(descs, host(mem_type))

        def get_xfer_descs(self, descs, mem_type=None):
            return super().get_xfer_descs(descs, host(mem_type))

        def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=None):
            return super().prep_xfer_dlist(agent_name, xfer_list, host(mem_type), backends)

    pd_xfer.nixl.install_as_nixl()
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        print(f"pd-suite launch.py: nixl is pd_xfer.nixl (pid {os.getpid()})", file=sys.stderr, flush=True)
        return
    # `nixl._api` is a module of its own here, so pd_xfer.nixl itself keeps its agent class.
    api = types.ModuleType("nixl._api", "pd_xfer.nixl with SGLang's CPU KV as host memory")
    api.__dict__.update({k: v for k, v in vars(pd_xfer.nixl).items() if not k.startswith("__")})
    api.nixl_agent = HostKvAgent
    sys.modules["nixl"]._api = api
    sys.modules["nixl._api"] = api
    print(f"pd-suite launch.py: nixl is pd_xfer.nixl, VRAM lists as DRAM (pid {os.getpid()})", file=sys.stderr, flush=True)


if os.environ.get("PD_SGLANG_NIXL") == "pd_xfer":
    _install_pd_xfer_as_nixl()

from sglang.srt.disaggregation.mooncake import conn as mooncake_conn  # noqa: E402

mooncake_conn.MooncakeKVSender.supports_host_tensor_indices = False
print(
    f"pd-suite launch.py: MooncakeKVSender.supports_host_tensor_indices = False (pid {os.getpid()})",
    file=sys.stderr,
    flush=True,
)

if __name__ == "__main__":
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__")
