"""`--quantization` with tensor parallelism: each rank quantizes its own 16-bit slices in situ as they load.

Column-parallel projections (q, k, v, gate, up) keep every output channel whole on one rank; a row-parallel
one (o, down) holds half of each channel's inputs, and int8's per-channel scale (amax / 127) then spans that
half. The reference is the checkpoint with exactly that rounding applied to its weights, run unquantized in
one process: two int8 ranks give its logits within fp32 rounding, and its greedy tokens."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from harness import PagedHarness
from tiny_models import make_hf_model, save_hf_model
from tp_ranks import free_port, run_rank, teacher_forced_logits

from inference_service.model.loader import load_model

PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [256, 84, 80, 33]]
NUM_NEW_TOKENS = 6
CHUNK = 5
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _int8_rounded(weight: torch.Tensor, num_slices: int) -> torch.Tensor:
    """`weight` [N, K] through symmetric int8 with one fp16 scale per channel and K-slice, back to its dtype."""
    n, k = weight.shape
    groups = weight.float().view(n, num_slices, k // num_slices)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    return (torch.round(groups / scale).clamp(-128, 127) * scale).view(n, k).to(weight.dtype)


def test_two_int8_ranks_match_the_checkpoint_rounded_as_the_ranks_round_it(tmp_path):
    hf_model = make_hf_model("llama", seed=3)
    path = save_hf_model(hf_model, str(tmp_path / "llama"))
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.endswith(COLUMN_PARALLEL + ROW_PARALLEL):
                module.weight.copy_(_int8_rounded(module.weight, 2 if name.endswith(ROW_PARALLEL) else 1))
    rounded_path = save_hf_model(hf_model, str(tmp_path / "llama-int8-rounded"))
    reference = load_model(rounded_path, dtype=torch.float32).model
    generated = PagedHarness(reference).generate(PROMPTS, NUM_NEW_TOKENS, prefill_chunk=CHUNK)
    forced = [tokens[:-1] for tokens in generated]
    expected = teacher_forced_logits(reference, PROMPTS, forced, CHUNK)
    unquantized = teacher_forced_logits(load_model(path, dtype=torch.float32).model, PROMPTS, forced, CHUNK)

    out_file = str(tmp_path / "rank0.pt")
    mp.start_processes(run_rank, args=(2, free_port(), [(path, PROMPTS, forced, CHUNK)], out_file, False, "int8"),
                       nprocs=2, join=True, start_method="spawn")
    saved = torch.load(out_file)
    got, summary = saved["logits"][0], saved["summaries"][0]
    assert summary[:2] == ("in-situ int8", 8)  # quantization, bits (on the CPU expanded to fp32 to run)
    for step, (g, e, u) in enumerate(zip(got, expected, unquantized, strict=True)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
        assert not torch.allclose(u, e, atol=1e-3), "the rounding must be visible in the logits"
    decode_steps = got[len(got) - len(forced[0]):]  # one a forced token: each gives the next greedy token
    assert [[int(t[i].argmax()) for t in decode_steps] for i in range(len(PROMPTS))] == [g[1:] for g in generated]
