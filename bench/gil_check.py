"""Does waiting for the GPU release the GIL? Counts another thread's loop iterations during a ~50 ms
GPU job waited on by `.tolist()` and by an event (`engine.sampler.to_host_list`)."""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from inference_service.engine.sampler import to_host_list  # noqa: E402

a = torch.randn(8192, 8192, device="cuda")
count, stop = [0], [False]


def spin():
    while not stop[0]:
        count[0] += 1


threading.Thread(target=spin, daemon=True).start()
for name, fetch in (("tolist", lambda t: t.tolist()), ("event", to_host_list)) * 2:
    torch.cuda.synchronize()
    b = a
    for _ in range(4):
        b = b @ a
    c0, t0 = count[0], time.perf_counter()
    fetch(b[0, :4].argmax().reshape(1))
    print(f"{name}: waited {1e3 * (time.perf_counter() - t0):.1f} ms, other thread ran {count[0] - c0} iterations")
stop[0] = True
