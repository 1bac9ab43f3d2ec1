"""Publishes KV events with vLLM's own ZmqEventPublisher (the class vLLM engines use), for
coordinator/tests/kv_collector.rs. Stores `blocks` blocks (integer hashes from `first_hash`)
in one batch, republished every 100 ms (a subscriber may join late; the index takes repeats
as no change) for 60 s or until killed. With RANK, it is that data-parallel rank's publisher
(vLLM then offsets both endpoints by the rank itself).

usage: python vllm_publisher.py ENDPOINT REPLAY_ENDPOINT TOPIC FIRST_HASH BLOCKS [RANK]
"""

import sys
import time

import msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

BLOCK_SIZE = 16


def stored(first_hash: int, blocks: int) -> BlockStored:
    known = {
        "block_hashes": list(range(first_hash, first_hash + blocks)),
        "parent_block_hash": None,
        "token_ids": list(range(blocks * BLOCK_SIZE)),
        "block_size": BLOCK_SIZE,
    }
    # Fields vLLM added over time (lora_id, medium, ...) get None unless they have defaults.
    kwargs = {}
    for field in msgspec.structs.fields(BlockStored):
        if field.name in known:
            kwargs[field.name] = known[field.name]
        elif field.required:
            kwargs[field.name] = None
    return BlockStored(**kwargs)


def main() -> None:
    endpoint, replay, topic, first_hash, blocks = sys.argv[1:6]
    rank = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    publisher = ZmqEventPublisher(data_parallel_rank=rank, endpoint=endpoint, replay_endpoint=replay, topic=topic)
    event = stored(int(first_hash), int(blocks))
    print(f"rank {rank} publishing {blocks} blocks under {topic!r} on {endpoint} (before the offset)", flush=True)
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
            time.sleep(0.1)
    finally:
        publisher.shutdown()


if __name__ == "__main__":
    main()
