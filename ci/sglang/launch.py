"""Starts `sglang.launch_server` with the one adjustment SGLang's CPU engine needs for P/D.

    python ci/sglang/launch.py --model-path DIR ...   # the arguments of sglang.launch_server

Mooncake's sender declares `supports_host_tensor_indices = True`, which makes the prefill ask
torch for pinned CUDA host memory in `_send_kv_chunk` and crash on a machine without CUDA. With
the attribute False the sender takes its plain numpy path (../../shared/SGLANG_CPU.md, item 2).
The attribute is set here at start-up, never in an edited copy of SGLang.

SGLang starts its scheduler in `spawn`ed processes; those run the main module's top level again
(as `__mp_main__`). This file stays the main module (runpy without `alter_sys`), so the
adjustment applies in every process, while only the first process runs the server; each says so
on stderr. This directory also holds our `sgl_kernel` stand-in and is on `sys.path` first.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
