"""Decode throughput of the embedded SmolLM2 through the paged harness (not a test; run by hand):

    PYTHONPATH=. python tests/model/bench_decode.py 1 16
"""
import os
import time, sys, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inference_service.model.loader import load_model
from harness import PagedHarness
lm = load_model(None)
h = PagedHarness(lm.model, num_blocks=512)
ids = lm.tokenizer.encode(lm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a dragon."}]), add_special_tokens=False)
def run(bs, n):
    tables = [[] for _ in range(bs)]; cached = [0]*bs
    h.step([ids]*bs, cached, tables); cached = [len(ids)]*bs
    ts = []
    for i in range(n):
        t = time.perf_counter(); h.step([[5]]*bs, cached, tables); ts.append(time.perf_counter()-t); cached = [c+1 for c in cached]
    ts.sort()
    h.free_blocks.extend(b for t in tables for b in t)
    return ts
for bs in [int(x) for x in sys.argv[1:]]:
    ts = run(bs, 40)
    med = ts[len(ts)//2]
    print(f"bs={bs} median step {med*1000:.1f} ms  min {ts[0]*1000:.1f} ms  -> {bs/med:.1f} tok/s (best {bs/ts[0]:.1f})")
