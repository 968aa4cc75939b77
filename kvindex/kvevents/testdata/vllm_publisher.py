#!/usr/bin/env python3
"""A vLLM-format KV-event publisher on real libzmq sockets, for kvevents' interop test.

Binds a PUB socket and a ROUTER replay socket on 127.0.0.1 (random ports), publishes the
script() batches below with sequence numbers 0, 1, ... before anyone can subscribe (so a
subscriber only gets them by replay, like one that joins a running engine), prints
"READY <pub_port> <replay_port>", then publishes empty heartbeat batches every 20 ms (the live
path), while answering
replay requests the way vLLM's ZmqEventPublisher does: for a request [identity, "", start_seq]
it sends [identity, "", seq, payload] for every buffered batch with seq >= start_seq, then the
END marker [identity, "", 0xffffffffffffffff, ""]. Live messages are [topic, seq, payload] with
seq as 8 bytes big-endian. It exits when stdin closes or after 60 s.

The Go test (interop_test.go) builds the same batches with kveventstest and expects the index
the subscriber builds from this process to equal the one built from its own encoding, so keep
both in sync.

Requires Debian's python3-zmq and python3-msgpack; run it with /usr/bin/python3.
"""

import select
import sys
import time

import msgpack
import zmq

BS = 4
END_SEQ = (2**64 - 1).to_bytes(8, "big")


def toks(family, i):
    b = family * 1000 + i * 4
    return [b, b + 1, b + 2, b + 3]


def chain(family, start, stop):
    return [t for i in range(start, stop) for t in toks(family, i)]


def ext(family, i):
    return (family << 32) + i + 1


def digest(h):
    """A 32-byte block digest whose last 8 bytes are h (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return b"\xab" * 24 + h.to_bytes(8, "big")


def script(ts):
    return [
        # 0: vLLM array form with the 8-field BlockStored layout, integer hashes, dp rank 0.
        [ts, [["BlockStored", [ext(1, 0), ext(1, 1)], None, chain(1, 0, 2), BS, None, "GPU", None]], 0],
        # 1: omit_defaults style: trailing defaults dropped, 2-element batch without a rank.
        [ts, [["BlockStored", [ext(1, 2)], ext(1, 1), chain(1, 2, 3), BS]]],
        # 2: raw digest hashes sent as msgpack bin.
        [ts, [["BlockStored", [digest(ext(2, 0)), digest(ext(2, 1))], None, chain(2, 0, 2), BS, None, None, None]], 0],
        # 3: a map-form event with a top-level cache_salt (namespace "tenant-a").
        [ts, [{"type": "BlockStored", "block_hashes": [ext(3, 0)], "parent_block_hash": None,
               "token_ids": chain(3, 0, 1), "block_size": BS, "lora_id": None, "medium": "GPU",
               "lora_name": None, "cache_salt": "tenant-a"}], 0],
        # 4: an SGLang-style signed hash; the child inherits its parent's namespace.
        [ts, [["BlockStored", [-5], ext(3, 0), chain(3, 1, 2), BS, None, None, None]], 0],
        # 5: a removal and a CPU offload of the same block (host tier).
        [ts, [["BlockRemoved", [ext(1, 2)], "GPU"],
              ["BlockStored", [ext(1, 2)], ext(1, 1), chain(1, 2, 3), BS, None, "CPU", None]], 0],
        # 6: a hybrid model: the sliding-window group is skipped, full attention indexed.
        [ts, [["BlockStored", [ext(5, 0)], None, chain(5, 0, 1), BS, None, "GPU", None, None, 1,
               "sliding_window", 128, None],
              ["BlockStored", [ext(5, 0)], None, chain(5, 0, 1), BS, None, "GPU", None, None, 0,
               "full_attention", None, None]], 0],
    ]


def main():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 100000)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    batches = [msgpack.packb(b, use_bin_type=True) for b in script(time.time())]
    ring = []
    seq = 0
    for payload in batches:
        ring.append((seq, payload))
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
    print(f"READY {pub_port} {replay_port}", flush=True)

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)

    deadline = time.monotonic() + 60
    next_pub = time.monotonic()
    while time.monotonic() < deadline:
        timeout_ms = max(0, int((next_pub - time.monotonic()) * 1000))
        ready = dict(poller.poll(timeout_ms))
        if sys.stdin.fileno() in ready:
            r, _, _ = select.select([sys.stdin], [], [], 0)
            if r and not sys.stdin.buffer.read1(1024):
                break
        if router in ready:
            frames = router.recv_multipart()
            if len(frames) == 3 and len(frames[2]) == 8:
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                for s, payload in ring:
                    if s >= start:
                        router.send_multipart([ident, b"", s.to_bytes(8, "big"), payload])
                router.send_multipart([ident, b"", END_SEQ, b""])
        if time.monotonic() >= next_pub:
            payload = msgpack.packb([time.time(), [], 0], use_bin_type=True)
            ring.append((seq, payload))
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            next_pub += 0.02
    pub.close(linger=0)
    router.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    main()
