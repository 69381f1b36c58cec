"""Throwaway: one-row norm / SiLU launch configs in the step (int4 / fp8 batch 1), variants alternated in one process."""
import argparse, gc, json, os, sys
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import gpu_common, gpu_perf, torch
from gpu_quant_served import batch1_decode_tok_s
import kernels.norm as norm_mod
import kernels.activation as act_mod

import kernels.decode_attention as attn_mod
NORM_K, SILU_K = norm_mod._rms_norm_kernel, act_mod._silu_and_mul_kernel
TILES = attn_mod._decode_tiles


class Wrap:
    def __init__(self, kernel, fn):
        self.kernel, self.fn = kernel, fn

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        fn = self.fn
        def call(*a, **kw):
            if grid[0] < 132:
                kw = fn(kw)
            return launch(*a, **kw)
        return call


def set_variant(name):
    norm_mod._rms_norm_kernel, act_mod._silu_and_mul_kernel = NORM_K, SILU_K
    attn_mod._decode_tiles = TILES
    if name.startswith("attn"):  # attn:bn,warps,stages at grids of few programs (batch 1)
        bn, w, st = (int(v) for v in name.split(":")[1].split(","))
        def tiles(dtype, fp16_dots, num_programs, head_dim, device, block_n, num_warps, num_stages):
            if num_programs <= 4 * 132 and block_n is None:
                return bn, {"num_warps": w, "num_stages": st}
            return TILES(dtype, fp16_dots, num_programs, head_dim, device, block_n, num_warps, num_stages)
        attn_mod._decode_tiles = tiles
    if name.startswith("norm"):
        w = int(name[4:])
        norm_mod._rms_norm_kernel = Wrap(NORM_K, lambda kw: {**kw, "num_warps": w})
    elif name.startswith("silu"):
        block, w = (int(v) for v in name[4:].split("w"))
        # the grid was made with block 1024: relaunch with the variant's block over the same rows
        class S:
            def __getitem__(self, grid):
                def call(x, out, sx, so, D, BLOCK, **kw):
                    g = (grid[0], -(-D // block))
                    kw["num_warps"] = w
                    return SILU_K[g](x, out, sx, so, D=D, BLOCK=block, **kw)
                return call if grid[0] == 1 else SILU_K[grid]
        act_mod._silu_and_mul_kernel = S()


def batch_decode_tok_s(engine, batch, tag, prompt_len=128, new_tokens=256):
    import time
    from inference_service.engine.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(0, 128000, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(engine.input_processor.process(f"{tag}-{i}", prompt, params))
    stamps = [time.perf_counter()]
    while engine.has_unfinished:
        engine.step()
        stamps.append(time.perf_counter())
    # steps -230 .. -30: every sequence decoding (prefills done in the first few steps, none finished yet)
    return batch * 200 / (stamps[-30] - stamps[-230])


p = argparse.ArgumentParser()
p.add_argument("--method", default="int4")
p.add_argument("--variants", nargs="+", default=["base"])
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--out", default="")
p.add_argument("--batch", type=int, default=1)
args = p.parse_args()
gpu_common.DEVICE = "cuda"
loaded, _ = gpu_perf.load_llama(quantization=args.method)
rows = []
for rnd in range(args.rounds):
    for v in args.variants:
        set_variant(v)
        loaded.model.stack.can_fold_gemv = None
        engine = gpu_common.make_engine(loaded.model_path, "cuda", "bfloat16", load_format="dummy", loaded=loaded,
                                        max_cuda_graph_batch_size=max(8, args.batch))
        if args.batch == 1:
            tok_s = batch1_decode_tok_s(engine, request_id=f"r{rnd}{v}")
        else:
            tok_s = batch_decode_tok_s(engine, args.batch, f"r{rnd}{v}")
        row = {"method": args.method, "variant": v, "round": rnd, "tok_s": round(tok_s, 1),
               "mma_v3_disabled": os.environ.get("DISABLE_MMA_V3", "")}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine
        gc.collect()
        gpu_common.free_device_memory()
set_variant("base")
if args.out:
    json.dump(rows, open(args.out, "w"), indent=1)
