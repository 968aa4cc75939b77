"""A replica-sync peer built on libzmq (pyzmq) and msgpack-python, as another implementation of
the dynamo.slot-tracker.v1 wire format would be: it subscribes to the kvepp PUB endpoint given in
argv[1], binds its own PUB socket and prints its endpoint, then until stdin closes it publishes one
admission (built as a plain map, with small integers) every 50 ms and prints every slot-tracker
message it receives from kvepp as one JSON line."""
import json
import sys
import threading

import msgpack
import zmq

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.LINGER, 0)
sub.setsockopt(zmq.SUBSCRIBE, b"dynamo.slot-tracker.v1")
sub.setsockopt(zmq.SUBSCRIBE, b"dynamo.session-affinity.v1")
sub.connect(sys.argv[1])
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.LINGER, 0)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(json.dumps({"endpoint": "tcp://127.0.0.1:%d" % port}), flush=True)

stop = threading.Event()


def stdin_closed():
    sys.stdin.read()
    stop.set()


threading.Thread(target=stdin_closed, daemon=True).start()
admission = msgpack.packb({
    "model_name": "Qwen/Qwen3-0.6B",
    "routing_group": "default",
    "block_size": 16,
    "event": {
        "request_id": "py-1",
        "worker": {"worker_id": 3, "dp_rank": 0},
        "router_id": 77,
        "lora_name": None,
        "data": {"AddRequest": {
            "token_sequence": [1, 2**64 - 1],
            "track_prefill_tokens": True,
            "expected_output_tokens": 10,
            "prefill_load_hint": {"initial_effective_prefill_tokens": 24, "expected_prefill_duration": None},
        }},
    },
})
poller = zmq.Poller()
poller.register(sub, zmq.POLLIN)
while not stop.is_set():
    pub.send_multipart([b"dynamo.slot-tracker.v1", admission])
    for sock, _ in poller.poll(50):
        topic, payload = sock.recv_multipart()
        msg = msgpack.unpackb(payload, raw=False)
        print(json.dumps({"topic": topic.decode(), "msg": msg}), flush=True)
