"""The Gluon int4 GEMV compiled for sm_90a without a GPU (PTX to /tmp): what the loop issues, its shared memory.

    pip download triton==3.6.0 --no-deps -d /tmp/t36 && pip install --no-deps --target /tmp/t36site /tmp/t36/*.whl
    PYTHONPATH=/tmp/t36site python bench/experiments/gluon_int4_gemv/compile_int4.py
(then `ptxas -v --gpu-name sm_90a` from triton/backends/nvidia/bin for registers and serialization warnings)
"""
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_gemv_gluon import int4_gemv_kernel as k  # noqa: E402

PTRS = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "r_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
        "count_ptr": "*i32"}
ALIGNED = set(PTRS) | {"N", "K", "stride_xm", "stride_rm", "stride_ym"}  # what the JIT finds divisible by 16

for k_split, split, residual in ((4096, 1, False), (2048, 2, False), (1792, 8, True)):  # gate_up, qkv, down
    consts = dict(ZERO_PAIR=0x43084308, K_SPLIT=k_split, SPLIT_K=split, RESIDUAL=residual, USE_PDL=True,
                  DEPTH=3 if split == 1 else 2)
    sig = {n: ("constexpr" if n in consts else PTRS.get(n, "i32")) for n in k.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if n in ALIGNED}
    kern = triton.compile(gluon._runtime.GluonASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
    ptx = kern.asm["ptx"]
    print(f"K range {k_split}, split {split}: wgmma {ptx.count('wgmma.mma_async')}, waits",
          sorted(set(re.findall(r"wgmma.wait_group.sync.aligned \d+", ptx))), "global loads",
          sorted(set(re.findall(r"ld\.global[\.a-z0-9]*", ptx))), f"shared loads {len(re.findall(r'ld.shared', ptx))},",
          f"bar.sync {ptx.count('bar.sync')}, shared memory {kern.metadata.shared}")
    with open(f"/tmp/int4_gluon_{k_split}_{split}.ptx", "w") as f:
        f.write(ptx)
