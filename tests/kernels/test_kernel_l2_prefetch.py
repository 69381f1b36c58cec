"""L2 prefetch of the next projections' weights during a small batch's attention (`kernels/l2_prefetch.py`).

The chunk plans are checked exactly on any machine; the launch itself (a Hopper instruction) runs only
compiled on a GPU that has it, where it must change nothing: a prefetch is a hint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from inference_service.model import fused_stack
from inference_service.model.config import ModelConfig
from inference_service.model.decoder import DecoderModel
from inference_service.model.loader import load_model
from kernels.l2_prefetch import PrefetchPlan, can_prefetch_l2, default_prefetch_bytes, plan_chunks
from tests.grpc_client import REPO_ROOT
from tests.kernels.kernel_testlib import DEVICE
from tests.kernels.test_kernel_fused_decoder import COMMON, FAMILIES, _build
from tests.model.tiny_models import make_hf_model, save_hf_model
from tests.quant.checkpoints import TINY_LLAMA


def test_chunks_cover_the_tensors_in_order_up_to_the_budget():
    first = torch.zeros(40_000, dtype=torch.float32)  # 160,000 bytes
    second = torch.zeros(1_000, dtype=torch.bfloat16)  # 2,000 bytes
    a, b = first.data_ptr(), second.data_ptr()
    chunks = plan_chunks([first, second], max_bytes=160_000 + 1_000, chunk_bytes=16_384)
    whole = [(a + i * 16_384, 16_384) for i in range(9)] + [(a + 9 * 16_384, 160_000 - 9 * 16_384)]
    # the second tensor's 1,000 budgeted bytes, rounded down to 16
    assert chunks == whole + [(b, 992)]
    assert plan_chunks([first, second], max_bytes=100, chunk_bytes=64) == [(a, 64), (a + 64, 32)]
    assert plan_chunks([first], max_bytes=0) == []


def test_chunks_skip_an_unaligned_head_and_a_short_tail():
    buffer = torch.zeros(256, dtype=torch.uint8)
    view = buffer[3:250]  # starts 3 bytes into a 16-aligned allocation, 247 bytes long
    start = buffer.data_ptr()
    assert start % 16 == 0
    assert plan_chunks([view], max_bytes=1 << 20, chunk_bytes=64) == [
        (start + 16, 64), (start + 80, 64), (start + 144, 64), (start + 208, 32)]


def test_chunk_size_must_suit_the_instruction():
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([torch.zeros(4)], max_bytes=16, chunk_bytes=24)


def test_plan_table_is_address_and_size_pairs():
    weight = torch.zeros(64, 64, dtype=torch.float16, device=DEVICE)
    plan = PrefetchPlan([weight], max_bytes=5_000, chunk_bytes=2_048)
    assert plan.table.dtype == torch.int64 and plan.table.device == weight.device
    assert plan.table.tolist() == [[weight.data_ptr(), 2_048], [weight.data_ptr() + 2_048, 2_048],
                                   [weight.data_ptr() + 4_096, 896]]
    assert plan.num_bytes == 5_000 - 8
    plan.launch()  # a no-op where the device cannot prefetch; a hint that changes nothing where it can
    assert torch.count_nonzero(weight) == 0


def test_no_prefetch_where_the_device_has_no_instruction_for_it():
    assert not can_prefetch_l2(torch.device("cpu"))
    assert default_prefetch_bytes(torch.device("cpu")) == 0


def _table(plan: PrefetchPlan) -> list[tuple[int, int]]:
    return [tuple(row) for row in plan.table.tolist()]


def test_stack_prefetches_each_quantized_layers_o_then_gate_up(tmp_path, monkeypatch):
    """Each layer's plan covers its o projection's packed codes whole, then its gate_up's first bytes up to the
    budget; no plans with a zero budget."""
    init = DecoderModel.__init__
    monkeypatch.setattr(DecoderModel, "__init__",
                        lambda self, config, **kw: init(self, config, **{**kw, "fused_kernels": True}))
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    model = load_model(folder, device="cpu", quantization="int4").model
    layers = model.model.layers
    o_codes = [layer.self_attn.o_proj.packed_parts()[0].qs for layer in layers]
    gate_up_codes = [layer.mlp.gate_up_proj.packed_parts()[0].qs for layer in layers]
    budget = o_codes[0].nbytes + 1_000
    monkeypatch.setattr(fused_stack, "default_prefetch_bytes", lambda device: budget)
    model.stack.plan_folding()
    plans = model.stack.prefetch_plans
    assert len(plans) == len(layers) >= 2
    for plan, o, gate_up in zip(plans, o_codes, gate_up_codes, strict=True):
        assert _table(plan) == plan_chunks([o], o.nbytes) + [(gate_up.data_ptr(), 992)]
    monkeypatch.setattr(fused_stack, "default_prefetch_bytes", lambda device: 0)
    model.stack.plan_folding()
    assert model.stack.prefetch_plans == []


def test_stack_does_not_prefetch_16_bit_weights(monkeypatch):
    """bf16 weights stream at ~0.95 of the copy rate at batch 1 already: the prefetch measured no gain there."""
    model = _build(ModelConfig.from_hf_dict({**COMMON, **FAMILIES["llama"]}), fused=True)
    monkeypatch.setattr(fused_stack, "default_prefetch_bytes", lambda device: 1 << 20)
    model.stack.plan_folding()
    assert model.stack.prefetch_plans == []


def test_kernel_compiles_for_hopper_with_its_prefetch_kept():
    """Compiled for sm_90 here (no GPU needed: Triton's own ptxas), the prefetch survives although nothing
    reads the asm's result, and ptxas takes the instruction as written."""
    pytest.importorskip("triton.backends.nvidia")
    # In a process of its own, without the interpreter: the interpreter that runs the other kernel tests here
    # patches triton.language in place, and what an interpreted call of a @triton.jit helper patched stays
    # patched (Triton 3.9), which breaks a later compile in the same process.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    prefetches, has_cubin = json.loads(result.stdout.splitlines()[-1])
    assert len(prefetches) == 1 and "@p" in prefetches[0]
    assert has_cubin


_COMPILE_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.l2_prefetch import CHUNKS_PER_PROGRAM, _prefetch_l2_kernel
source = ASTSource(fn=_prefetch_l2_kernel, signature={"table_ptr": "*i64", "num_chunks": "i32", "BLOCK": "constexpr"},
                   constexprs={"BLOCK": CHUNKS_PER_PROGRAM})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
ptx = compiled.asm["ptx"].splitlines()
print(json.dumps([[line for line in ptx if "cp.async.bulk.prefetch.L2.global" in line], bool(compiled.asm["cubin"])]))
"""