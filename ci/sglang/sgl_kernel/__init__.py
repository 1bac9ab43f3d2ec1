"""pd-suite's stand-in for SGLang's `sgl_kernel`, for SGLang's CPU engine on machines without it.

PyPI has no CPU build of `sgl_kernel`, yet SGLang's CPU engine imports two functions from it at
start-up. This package implements those two with plain torch (and, for the one that receives raw
addresses, a ctypes view of the memory). Every other name raises NotImplementedError when
called: on a CPU without AMX only speculative decoding and AMX kernels reach them.
Put this directory's parent on PYTHONPATH (ci/sglang/launch.py does).
"""

import ctypes

import torch

__version__ = "0.0.0+pd-suite-cpu-stand-in"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i, writes its slice of `out_cache_loc` (the requests' slices are laid
    end to end) into row `req_pool_indices[i]` of `req_to_token`, columns
    `start_offset[i]..end_offset[i]`."""
    del pool_len  # the row length is req_to_token.shape[1]
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(
            req_to_token.dtype
        )
        taken += count


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer (address `data_ptrs[b]`, rows of `strides[b]` bytes), copies row
    `src_loc[i]` onto row `tgt_loc[i]`. The source rows are read before any write, so
    overlapping moves are safe."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max()).item()) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buffer[tgt] = buffer[src]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def not_implemented(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by pd-suite's CPU stand-in "
            "(ci/sglang/sgl_kernel): only assign_req_to_token_pool_cpu and "
            "copy_all_layer_kv_cache_cpu are"
        )

    not_implemented.__name__ = name
    return not_implemented
