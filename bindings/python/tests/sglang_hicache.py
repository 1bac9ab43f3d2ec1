"""SGLang's HiCache NIXL storage (``sglang.srt.mem_cache.storage.nixl``), unchanged, storing and
loading real host KV pools through pd_xfer standing in for NIXL (POSIX backend, files in a
temporary directory). Run with the SGLang venv's python and pd_xfer on PYTHONPATH;
test_sglang_hicache.py does. Prints one ``@@`` JSON line with what it saw; any failed check
raises.

For each host-pool layout (layer_first: one file per page through bounce buffers;
page_first and page_first_direct: zero copy, a K and a V file per page), with direct I/O off
and on: no page is stored at first; a batch stored from random pages is found; loaded into
other host slots after the pool is zeroed, every byte is equal; the zero-copy files hold exactly
the K and V halves; a batch naming a page never stored loads nothing for it; no file of the
store is left open."""

import json
import os
import shutil
import sys
import tempfile

import pd_xfer.nixl

pd_xfer.nixl.install_as_nixl()

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl  # noqa: E402

# head_dim 64: a page half is 16 tokens × 2 layers × 2 heads × 64 × 2 bytes = 8 KiB, so the
# zero-copy layouts stay page-aligned for O_DIRECT.
LAYERS, HEADS, HEAD_DIM, PAGE_SIZE, DTYPE = 2, 2, 64, 16, torch.bfloat16
PAGES = 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_pool(layout: str) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(
        size=32 * PAGE_SIZE, page_size=PAGE_SIZE, dtype=DTYPE, head_num=HEADS, head_dim=HEAD_DIM,
        layer_num=LAYERS, device="cpu", enable_memory_saver=False, start_layer=0, end_layer=LAYERS,
    )
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE_SIZE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
    )


def storage(directory: str, direct_io: bool) -> HiCacheNixl:
    os.environ["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = directory
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="pd/hicache-test",
        extra_config={"plugin": {"posix": {"active": True}}, "use_direct_io": direct_io, "l3_cleaner_enabled": False},
    )
    return HiCacheNixl(config)


def page_starts(indices: torch.Tensor) -> list[int]:
    return [int(indices[i * PAGE_SIZE]) for i in range(len(indices) // PAGE_SIZE)]


def open_files_under(directory: str) -> int:
    fds = os.listdir("/proc/self/fd")
    return sum(os.path.realpath(f"/proc/self/fd/{fd}").startswith(directory + os.sep) for fd in fds)


def direct_io_works(directory: str) -> bool:
    try:
        fd = os.open(os.path.join(directory, "probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    return True


def round_trip(layout: str, directory: str, direct_io: bool) -> dict:
    host = host_pool(layout)
    store = storage(directory, direct_io)
    store.register_mem_pool_host(host)
    assert store.backend_selector.backend_name == "POSIX" and store.backend_selector.mem_type == "FILE"
    keys = [f"{layout}-{direct_io}-{i:04d}-" + "ab" * 24 for i in range(PAGES)]
    source, target = host.alloc(PAGES * PAGE_SIZE), host.alloc(PAGES * PAGE_SIZE)
    expected = []
    for start in page_starts(source):
        page = torch.randn(host.get_dummy_flat_data_page().numel()).to(DTYPE)
        host.set_from_flat_data_page(start, page)
        expected.append(page.clone())

    assert store.batch_exists(keys) == 0, "pages found before any was stored"
    assert store.batch_set_v1(keys, source) == [True] * PAGES
    assert store.batch_exists(keys) == PAGES
    assert store.batch_exists(keys + ["never-stored"]) == PAGES
    if store.is_zero_copy:
        # The K and V halves of the first page, each in a file of its own.
        k_half, v_half = host.get_data_page(page_starts(source)[0], flat=False).unbind(0)
        for half, suffix in ((k_half, "_k"), (v_half, "_v")):
            path = store.file_manager.get_file_path(store._get_suffixed_key(keys[0]) + suffix)
            with open(path, "rb") as f:
                assert f.read() == half.contiguous().view(torch.uint8).numpy().tobytes(), f"{path} differs"

    host.kv_buffer.zero_()
    assert store.batch_get_v1(keys, target) == [True] * PAGES
    for i, start in enumerate(page_starts(target)):
        loaded = host.get_data_page(start, flat=True)
        assert torch.equal(loaded.view(torch.int16), expected[i].view(torch.int16)), f"page {i} differs"

    # A batch naming a page never stored: nothing is loaded for it, no exception.
    missing = store.batch_get_v1([keys[0], "never-stored"], host.alloc(2 * PAGE_SIZE))
    assert missing[-1] is False, missing
    left_open = open_files_under(directory)
    store.close()
    files = sum(len(names) for _, _, names in os.walk(directory))
    return {
        "zero_copy": store.is_zero_copy, "path_mode": store.registry.path_mode, "files": files,
        "pages": PAGES, "left_open": left_open, "missing_batch": missing,
    }


def main() -> None:
    root = tempfile.mkdtemp(prefix="pd-hicache-")
    try:
        direct = direct_io_works(root)
        seen = {}
        for layout in LAYOUTS:
            for direct_io in (False, True) if direct else (False,):
                seen[f"{layout} direct_io={direct_io}"] = round_trip(
                    layout, os.path.join(root, f"{layout}-{direct_io}"), direct_io
                )
        if not direct:
            print(f"direct I/O: O_DIRECT is refused under {root}; only buffered I/O was run", file=sys.stderr)
        print("@@" + json.dumps(seen))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
