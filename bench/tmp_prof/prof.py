import os, sys
sys.path.insert(0, os.getcwd())
import torch
from kernels.quant_gemv import quant_gemv
from kernels.quant_gemv_tc import quant_gemv_tc
from kernels.quant_layout import IntPackedWeight
n, k = 28672, 4096
w = IntPackedWeight(4, 128, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
                    (torch.rand(n, k // 128, device="cuda") * 0.002).to(torch.float16), zero=8)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
nw = torch.rand(k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    quant_gemv_tc(x, w)
    quant_gemv(x, w, block_k=1024, norm_weight=nw)
    quant_gemv_tc(x, w, norm_weight=nw)
torch.cuda.synchronize()
