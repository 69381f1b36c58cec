"""CPU: `repack_thread_major` against the kernel's reading of it, element by element (t, w, v) -> (n, k)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_gemv_gluon import repack_thread_major  # noqa: E402

n, k = 128, 256
q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
words = repack_thread_major(q)  # [n/64, k/128, 128, 8]
got = torch.full((n, k), -1, dtype=torch.int32)
for nt in range(n // 64):
    for kt in range(k // 128):
        for t in range(128):
            n5n4, lane = divmod(t, 32)
            for w in range(8):
                word = int(words[nt, kt, t, w]) & 0xFFFFFFFF
                b = [(word >> (8 * i)) & 0xFF for i in range(4)]
                # the widen asm's outputs v0..v7 and their (n3, k0, k3) per the kernel's joins
                vals = [b[0] & 15, b[1] & 15, b[0] >> 4, b[1] >> 4, b[2] & 15, b[3] & 15, b[2] >> 4, b[3] >> 4]
                for v, val in enumerate(vals):
                    k0, n3, k3 = v & 1, (v >> 1) & 1, (v >> 2) & 1
                    nn = 16 * n5n4 + 8 * n3 + lane // 4
                    kk = 16 * w + 8 * k3 + 2 * (lane % 4) + k0
                    got[nt * 64 + nn, kt * 128 + kk] = val
assert (got >= 0).all(), "some codes not placed"
assert torch.equal(got, q.to(torch.int32)), "repack disagrees with the kernel's reading"
print("repack ok")
