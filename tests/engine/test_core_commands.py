"""Commands to the engine core process are written from the event loop: never blocking it, none lost or reordered."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from inference_service.engine.commands import AbortRequest
from inference_service.engine.core_client import CoreClient
from inference_service.metrics import EngineMetrics

NUM_COMMANDS = 300
ID_CHARS = 2000  # 300 commands of ~2 KB: several times what a pipe holds (64 KiB on Linux)


def make_client():
    commands_recv, commands_send = multiprocessing.Pipe(duplex=False)
    outputs_recv, outputs_send = multiprocessing.Pipe(duplex=False)
    process = SimpleNamespace(join=lambda timeout=None: None, exitcode=-9)
    client = CoreClient(process, commands_send, outputs_recv, SimpleNamespace(),
                        metrics=EngineMetrics("test", registry=CollectorRegistry()))
    return client, commands_recv, outputs_send


async def core_dies(client: CoreClient, core_end, outputs_send) -> None:
    core_end.close()
    outputs_send.close()
    await asyncio.sleep(0.05)
    assert client.is_dead


def request_id(i: int) -> str:
    return f"{i:05d}-" + "x" * ID_CHARS


async def test_a_full_pipe_never_blocks_the_loop_and_every_command_arrives_in_order():
    client, core_end, outputs_send = make_client()
    client.start()
    for i in range(NUM_COMMANDS // 2):
        client.abort(request_id(i))
    await asyncio.sleep(0)
    for i in range(NUM_COMMANDS // 2, NUM_COMMANDS):  # more while the first ones fill the pipe
        client.abort(request_id(i))
    # Nobody reads yet: the pipe is full, and the loop still runs everything else.
    started = time.monotonic()
    await asyncio.sleep(0.2)
    assert time.monotonic() - started < 1.0
    assert len(client._unwritten) > 0
    received: list = []

    def read_like_the_core() -> None:
        while len(received) < NUM_COMMANDS:
            received.extend(core_end.recv())

    reader = threading.Thread(target=read_like_the_core, daemon=True)
    reader.start()
    await asyncio.wait_for(asyncio.to_thread(reader.join), 30)
    assert received == [AbortRequest(request_id(i)) for i in range(NUM_COMMANDS)]
    assert len(client._unwritten) == 0 and not client._is_waiting_writable
    await core_dies(client, core_end, outputs_send)


async def test_commands_of_one_loop_iteration_go_out_as_one_message():
    client, core_end, outputs_send = make_client()
    client.start()
    for i in range(3):
        client.abort(f"r{i}")
    await asyncio.sleep(0.05)
    assert core_end.poll(0)
    assert core_end.recv() == [AbortRequest("r0"), AbortRequest("r1"), AbortRequest("r2")]
    assert not core_end.poll(0)
    await core_dies(client, core_end, outputs_send)


async def test_a_gone_core_stops_the_writes_without_an_error():
    client, core_end, outputs_send = make_client()
    client.start()
    core_end.close()  # the core died: writing to its pipe fails with EPIPE
    client.abort("r0")
    await asyncio.sleep(0.05)
    assert client._commands.closed
    client.abort("r1")  # dropped: the outputs' reader reports the death
    await asyncio.sleep(0.05)
    await core_dies(client, core_end, outputs_send)
