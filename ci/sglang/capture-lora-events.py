"""Encodes KV-event batches with SGLang's own event recorder and publisher encoding, for the
coordinator's test of SGLang's LoRA and cache-salt events (coordinator/tests/data/).

The real CPU engine of the e2e suite cannot serve a LoRA adapter: its `--load-format dummy`
(no weights on disk) is also the adapter loader's, which refuses it ("DUMMY load_format should
use DummyModelLoader"). So the batches come from SGLang's `KVCacheEventRecorder` over radix-tree
nodes built as a request under adapter `sql-lora` leaves them (extra_key = the adapter's id,
named through `KvEventLoraNames` as the scheduler does), encoded as `ZmqEventPublisher` does.

    PATH=$VENV/bin:$PATH $VENV/bin/python ci/sglang/capture-lora-events.py OUT.msgpack
    # (ninja from the venv builds SGLang's native page hash on first use)

OUT holds the batches (4) one after another, each prefixed by its length (u32 big-endian).
"""

import sys
import time
from array import array

import msgspec

from sglang.srt.disaggregation.kv_events import KVEventBatch
from sglang.srt.lora.lora_registry import LoRARef
from sglang.srt.mem_cache.events import KVCacheEventRecorder, KvEventLoraNames
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

ADAPTER = "sql-lora"
PROMPT = list(range(100, 112))


class Req:
    """What `KvEventLoraNames.register` reads of a request."""

    def __init__(self, lora_id, extra_key):
        self.lora_id = lora_id
        self.extra_key = extra_key


def chain(parent, tokens, extra_key=None, cache_salt=None):
    node = TreeNode()
    node.parent = parent
    node.key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
    return node


def main() -> None:
    lora_id = LoRARef.deterministic_id(ADAPTER, "/adapters/sql")
    names = KvEventLoraNames()
    names.register(lora_id=lora_id, lora_name=ADAPTER)
    names.register(Req(lora_id, lora_id), ADAPTER)
    recorder = KVCacheEventRecorder(enabled=True, page_size=1, lora_names=names)
    root = TreeNode()
    root.key = RadixKey(array("q"), extra_key=None)
    root.hash_value = []

    batches = []

    def flush():
        batches.append(KVEventBatch(ts=time.time(), events=recorder.take(), attn_dp_rank=None))

    # 1. The prompt under the adapter, stored as two nodes in two batches (the second links to
    #    the first's last page); then the second node evicted.
    first = chain(root, PROMPT[:8], extra_key=lora_id)
    second = chain(first, PROMPT[8:], extra_key=lora_id)
    recorder.record_store(first)
    flush()
    recorder.record_store(second)
    flush()
    recorder.record_remove(second)
    flush()
    # 2. The same prompt for the base model, and under a cache salt.
    recorder.record_store(chain(root, PROMPT))
    recorder.record_store(chain(root, PROMPT, cache_salt="tenant-a"))
    flush()
    encoder = msgspec.msgpack.Encoder()
    with open(sys.argv[1], "wb") as out:
        for batch in batches:
            payload = encoder.encode(batch)
            out.write(len(payload).to_bytes(4, "big") + payload)
    print(f"{len(batches)} batches, lora_id {lora_id}", file=sys.stderr)


if __name__ == "__main__":
    main()
