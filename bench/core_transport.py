"""Micro-bench of the engine core -> front end transport: step messages/s at N sequences a step.

One message carries every sequence's new token of one step (what `StepOutput` carries): the request id,
the completion index, the token ids and the text. Sender and receiver are two processes, as in `serve`.

    python bench/core_transport.py [--num-seqs 384] [--num-messages 3000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import tempfile
import time


def _step_message(num_seqs: int, step: int) -> list[tuple]:
    return [(f"stream{i:06d}-req{i}", 0, [1000 + step % 7], " tok", None, None) for i in range(num_seqs)]


def _send_pipe(conn, num_seqs: int, num_messages: int) -> None:
    for step in range(num_messages):
        conn.send(_step_message(num_seqs, step))
    conn.close()


def _send_zmq(address: str, codec: str, num_seqs: int, num_messages: int) -> None:
    import msgspec
    import zmq
    sock = zmq.Context().socket(zmq.PUSH)
    sock.connect(address)
    encode = msgspec.msgpack.Encoder().encode if codec == "msgspec" else (lambda m: pickle.dumps(m, protocol=5))
    for step in range(num_messages):
        sock.send(encode(_step_message(num_seqs, step)), copy=False)
    sock.close(linger=-1)


def bench_pipe(num_seqs: int, num_messages: int) -> float:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_send_pipe, args=(send, num_seqs, num_messages))
    p.start()
    send.close()
    recv.recv()
    start = time.perf_counter()
    for _ in range(num_messages - 1):
        recv.recv()
    elapsed = time.perf_counter() - start
    p.join()
    return (num_messages - 1) / elapsed


def bench_zmq(codec: str, num_seqs: int, num_messages: int) -> float:
    import msgspec
    import zmq
    address = f"ipc://{tempfile.mktemp(prefix='core-bench-')}"
    sock = zmq.Context().socket(zmq.PULL)
    sock.bind(address)
    decode = msgspec.msgpack.Decoder().decode if codec == "msgspec" else pickle.loads
    p = mp.get_context("spawn").Process(target=_send_zmq, args=(address, codec, num_seqs, num_messages))
    p.start()
    decode(sock.recv(copy=False).buffer)
    start = time.perf_counter()
    for _ in range(num_messages - 1):
        decode(sock.recv(copy=False).buffer)
    elapsed = time.perf_counter() - start
    p.join()
    sock.close()
    return (num_messages - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=384)
    parser.add_argument("--num-messages", type=int, default=3000)
    args = parser.parse_args()
    rows = [("multiprocessing Pipe + pickle 5", bench_pipe(args.num_seqs, args.num_messages))]
    for codec in ("pickle", "msgspec"):
        try:
            rows.append((f"ZMQ ipc PUSH/PULL + {codec}", bench_zmq(codec, args.num_seqs, args.num_messages)))
        except ImportError as e:
            print(f"skipped ZMQ + {codec}: {e}")
    print(f"{args.num_seqs} sequences a step message")
    for name, rate in rows:
        print(f"  {name:34s} {rate:9.0f} messages/s  {rate * args.num_seqs / 1e6:6.2f} M tokens/s")


if __name__ == "__main__":
    main()
