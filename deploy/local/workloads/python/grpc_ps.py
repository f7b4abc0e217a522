#!/usr/bin/python3
"""A synchronous parameter server over gRPC, written with Python grpcio.

TensorFlow's parameter servers speak gRPC; this is a small, unmodified
third-party-stack stand-in for them: workers push a gradient and pull the
parameters back in one unary RPC per step, the server averages the gradients
of all workers of a step (a barrier) and applies them. It trains the same toy
objective as flowlane-train's parameter server (a sum of per-worker
quadratics whose optimum only the average of all gradients reaches), so a
run converges only if every worker's bytes arrived intact.

No generated code: grpcio's generic handlers with bytes (de)serialisers
(tensors travel as raw little-endian float32, as TensorFlow's own tensor
transport does).

    grpc_ps.py server --listen IP:PORT --params N --workers W
    grpc_ps.py worker --server IP:PORT --rank R --workers W --params N --steps S
"""

import argparse
import json
import struct
import sys
import threading
import time
from array import array
from concurrent import futures

import grpc

SERVICE = "flowlane.ps.ParameterServer"
LR = 0.5
BARRIER_TIMEOUT = 120.0


def optimum(i):
    return (i % 1000) / 1000.0 - 0.5


def offset(k, workers, i):
    centered = k - (workers - 1) / 2.0
    return 0.25 * centered * (1.0 if i % 2 == 0 else -1.0)


def loss(w):
    return 0.5 * sum((x - optimum(i)) ** 2 for i, x in enumerate(w)) / max(len(w), 1)


def identity(b):
    return b


class Server:
    def __init__(self, params, workers):
        self.workers = workers
        self.params = array("f", [0.0] * params)
        self.sum = [0.0] * params
        self.count = 0
        self.generation = 0
        self.done = 0
        self.cond = threading.Condition()
        self.finished = threading.Event()

    def push_pull(self, request, context):
        _worker, _step = struct.unpack_from("<II", request, 0)
        grad = array("f")
        grad.frombytes(request[8:])
        if len(grad) != len(self.params):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gradient has the wrong size")
        with self.cond:
            for i, g in enumerate(grad):
                self.sum[i] += g
            self.count += 1
            if self.count == self.workers:
                scale = LR / self.workers
                for i in range(len(self.params)):
                    self.params[i] -= scale * self.sum[i]
                    self.sum[i] = 0.0
                self.count = 0
                self.generation += 1
                self.cond.notify_all()
            else:
                gen = self.generation
                if not self.cond.wait_for(lambda: self.generation != gen, BARRIER_TIMEOUT):
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "a worker never pushed")
            return self.params.tobytes()

    def bye(self, request, context):
        with self.cond:
            self.done += 1
            if self.done == self.workers:
                self.finished.set()
        return b""


def serve(args):
    state = Server(args.params, args.workers)
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "PushPull": grpc.unary_unary_rpc_method_handler(
                state.push_pull, request_deserializer=identity, response_serializer=identity
            ),
            "Bye": grpc.unary_unary_rpc_method_handler(
                state.bye, request_deserializer=identity, response_serializer=identity
            ),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=args.workers + 4),
        handlers=(handler,),
        options=[("grpc.max_receive_message_length", 64 << 20)],
    )
    server.add_insecure_port(args.listen)
    server.start()
    print(json.dumps({"role": "grpc-ps-server", "listening": args.listen}), flush=True)
    state.finished.wait()
    server.stop(grace=2).wait()
    print(json.dumps({"role": "grpc-ps-server", "updates": state.generation}), flush=True)


def work(args):
    n = args.params
    targets = [optimum(i) + offset(args.rank, args.workers, i) for i in range(n)]
    w = array("f", [0.0] * n)
    first = loss(w)
    channel = grpc.insecure_channel(
        args.server, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
    push_pull = channel.unary_unary(
        "/%s/PushPull" % SERVICE, request_serializer=identity, response_deserializer=identity
    )
    bye = channel.unary_unary(
        "/%s/Bye" % SERVICE, request_serializer=identity, response_deserializer=identity
    )
    comm = 0.0
    for step in range(args.steps):
        grad = array("f", (w[i] - targets[i] for i in range(n)))
        t0 = time.monotonic()
        reply = push_pull(struct.pack("<II", args.rank, step) + grad.tobytes(), timeout=BARRIER_TIMEOUT)
        comm += time.monotonic() - t0
        w = array("f")
        w.frombytes(reply)
    bye(b"", timeout=30)
    channel.close()
    print(
        json.dumps(
            {
                "role": "grpc-ps-worker",
                "rank": args.rank,
                "steps": args.steps,
                "comm_s": comm,
                "loss_first": first,
                "loss_last": loss(w),
            }
        ),
        flush=True,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--listen", required=True)
    s.add_argument("--params", type=int, required=True)
    s.add_argument("--workers", type=int, required=True)
    w = sub.add_parser("worker")
    w.add_argument("--server", required=True)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--workers", type=int, required=True)
    w.add_argument("--params", type=int, required=True)
    w.add_argument("--steps", type=int, default=10)
    w.add_argument("--connect-timeout", type=float, default=30.0)
    args = p.parse_args()
    if args.role == "server":
        serve(args)
    else:
        work(args)


if __name__ == "__main__":
    sys.exit(main())
