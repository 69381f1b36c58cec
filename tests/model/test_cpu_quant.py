"""The CPU kernels that run GGUF Q4_0 / Q4_1 / Q8_0 blocks in place, against a float64 dequantize-then-matmul."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch

from harness import PagedHarness
from inference_service.cpu_kernels.quant import (
    QuantizedWeight,
    QuantType,
    dequantize_ref,
    dequantize_rows,
    load_extension,
    quant_matmul,
    quant_matmul_ref,
)
from inference_service.model.gguf_linear import MAX_QUANTIZED_MATMUL_ROWS, GGUFLinear, expands_for

EXTENSION = load_extension()
# Where a C++ compiler exists the extension must build: a broken build would otherwise pass as "skipped"
# while every GGUF silently ran expanded.
pytestmark = pytest.mark.skipif(EXTENSION is None and shutil.which("c++") is None, reason="no C++ compiler here")
ISAS = ("amx", "avx512", "avx2", "scalar")


def random_blocks(qtype: QuantType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks [rows, cols / 32 * block_bytes] uint8 with random quants and sane fp16 scales."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, qtype.block_bytes), dtype=np.uint8)
    blocks[:, :, 0:2] = rng.uniform(-0.1, 0.1, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if qtype is QuantType.Q4_1:
        blocks[:, :, 2:4] = rng.uniform(-0.2, 0.2, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_extension_builds():
    assert EXTENSION is not None, "the CPU kernels failed to build (see the warning logged by load_extension)"


@pytest.fixture(params=ISAS)
def isa(request):
    """Every SIMD path this CPU has (a path it lacks falls back to the next one down; AMX is skipped where
    missing, as the AVX-512 path runs already). AMX takes every call here, however few its rows."""
    in_effect = EXTENSION.limit_instruction_set(request.param)
    if request.param == "amx" and in_effect != "amx":
        EXTENSION.limit_instruction_set("amx")
        pytest.skip(f"no AMX here ({in_effect})")
    min_rows = EXTENSION.set_amx_min_rows(1)
    yield request.param
    EXTENSION.set_amx_min_rows(min_rows)
    EXTENSION.limit_instruction_set("amx")  # no cap: the best path this CPU has


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda t: t.name)
def test_blocks_decode_as_gguf_dequantizes_them(qtype):
    rng = np.random.default_rng()
    blocks = random_blocks(qtype, 7, 96, rng)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype.name])  # [7, 96] float32
    weight = QuantizedWeight.from_gguf_blocks(blocks, qtype)
    torch.testing.assert_close(dequantize_ref(weight), torch.from_numpy(expected).double(), rtol=0, atol=1e-6)
    assert torch.equal(dequantize_rows(weight), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", list(QuantType), ids=lambda t: t.name)
def test_matmul_matches_float64_reference(qtype, isa):
    rng = np.random.default_rng()
    # Odd weight row counts (a row left over after the pairs, a partial 16-row AMX tile; 250 rows split
    # over two tasks), several widths (the AMX path's K chunks: one, three of six blocks, four and three),
    # 600 rows (a task's second 256-row AMX panel starting after a shorter chunk), every batch 1..17 and
    # larger ones (several 16-token AMX tiles).
    for rows, cols in ((1, 32), (37, 96), (66, 160), (5, 576), (250, 576), (600, 224)):
        weight = QuantizedWeight.from_gguf_blocks(random_blocks(qtype, rows, cols, rng), qtype)
        for num_rows in [*range(1, 18), 33, 64, 100]:
            x = torch.randn(num_rows, cols)
            out = torch.full((num_rows, rows), float("nan"))
            quant_matmul(x, weight, out)
            expected = quant_matmul_ref(x, weight)
            scale = (x.double().abs() @ dequantize_ref(weight).abs().T).max()
            assert (out.double() - expected).abs().max() <= 1e-6 * scale, (isa, rows, cols, num_rows)


def test_matmul_writes_only_its_column_slice(isa):
    rng = np.random.default_rng()
    weight = QuantizedWeight.from_gguf_blocks(random_blocks(QuantType.Q4_1, 9, 64, rng), QuantType.Q4_1)
    x = torch.randn(3, 64)
    wide = torch.full((3, 20), -7.0)
    quant_matmul(x, weight, wide[:, 5:14])
    torch.testing.assert_close(wide[:, 5:14].double(), quant_matmul_ref(x, weight), rtol=1e-5, atol=1e-5)
    assert (wide[:, :5] == -7).all() and (wide[:, 14:] == -7).all()


def test_dequantize_rows_picks_rows_and_checks_range():
    rng = np.random.default_rng()
    weight = QuantizedWeight.from_gguf_blocks(random_blocks(QuantType.Q8_0, 50, 64, rng), QuantType.Q8_0)
    rows = torch.tensor([49, 0, 7, 7])
    assert torch.equal(dequantize_rows(weight, rows).double(), dequantize_ref(weight)[rows])
    with pytest.raises(RuntimeError, match="row 50 out of range"):
        dequantize_rows(weight, torch.tensor([50]))


def test_bad_shapes_are_refused():
    rng = np.random.default_rng()
    weight = QuantizedWeight.from_gguf_blocks(random_blocks(QuantType.Q4_0, 4, 64, rng), QuantType.Q4_0)
    with pytest.raises(RuntimeError, match="x has 96 columns, the weight 64"):
        quant_matmul(torch.randn(2, 96), weight)
    with pytest.raises(ValueError, match="do not match"):
        QuantizedWeight(QuantType.Q4_0, weight.qs[:, :16], weight.scales, weight.mins)


def test_linear_stacks_parts_and_expands_for_large_batches(isa):
    """q, k, v rows of different types in one layer; small batches run in blocks, large ones dense (in
    blocks too where the AMX path runs them)."""
    rng = np.random.default_rng()
    parts = [QuantizedWeight.from_gguf_blocks(random_blocks(t, n, 64, rng), t)
             for t, n in ((QuantType.Q4_1, 6), (QuantType.Q4_1, 3), (QuantType.Q8_0, 3))]
    linear = GGUFLinear(64, 12, bias=True, dtype=torch.float32, device="cpu")
    linear.bias.copy_(torch.randn(12))
    for first, part in zip((0, 6, 9), parts):
        linear.load_rows(first, part)
    linear.finish_loading()
    assert [(first, w.qtype, w.shape[0]) for first, w in linear.quantized] == [(0, QuantType.Q4_1, 9),
                                                                              (9, QuantType.Q8_0, 3)]
    assert linear.weight.numel() == 0  # the float copy is released
    assert not expands_for(MAX_QUANTIZED_MATMUL_ROWS)
    assert expands_for(MAX_QUANTIZED_MATMUL_ROWS + 1) == (isa != "amx")
    dense = torch.cat([dequantize_ref(p) for p in parts])
    for num_rows in (1, MAX_QUANTIZED_MATMUL_ROWS, MAX_QUANTIZED_MATMUL_ROWS + 1):
        x = torch.randn(num_rows, 64)
        expected = x.double() @ dense.T + linear.bias.double()
        # atol: the scalar path's sequential float32 sum of 64 products may cancel to ~1e-5 (about 1 in 70 draws)
        torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-4)


def test_linear_with_some_dense_rows_expands_the_rest():
    rng = np.random.default_rng()
    part = QuantizedWeight.from_gguf_blocks(random_blocks(QuantType.Q4_0, 4, 32, rng), QuantType.Q4_0)
    linear = GGUFLinear(32, 6, bias=False, dtype=torch.float32, device="cpu")
    dense_rows = torch.randn(2, 32)
    linear.load_rows(4, dense_rows)
    linear.load_rows(0, part)
    linear.keeps_weight = True  # the plain weight stays beside the packed one, to be read here
    linear.finish_loading()
    assert linear.quantized == []
    expected = torch.cat([dequantize_ref(part).float(), dense_rows])
    torch.testing.assert_close(linear.weight.detach(), expected, rtol=0, atol=1e-6)


def test_packed_model_generates_what_the_dequantized_model_does(smollm, smollm_dequantized, smollm_prompts):
    """The embedded Q4_1 GGUF run in its blocks against the same file expanded to float32 at load."""
    assert smollm.model.quantized_embedding is not None
    assert smollm.model.num_weight_bytes < smollm_dequantized.model.num_weight_bytes / 4
    prompts = smollm_prompts[:6]
    got = PagedHarness(smollm.model, num_blocks=128, block_size=16).generate(prompts, 32)
    expected = PagedHarness(smollm_dequantized.model, num_blocks=128, block_size=16).generate(prompts, 32)
    assert got == expected
    # The prompts' prefill runs the dense path without AMX (more rows than MAX_QUANTIZED_MATMUL_ROWS), the
    # blocks with it: check one row.
    long_prompt = [ids for ids in smollm_prompts if len(ids) > MAX_QUANTIZED_MATMUL_ROWS][0]
    logits = PagedHarness(smollm.model).step([long_prompt], [0], [[]])
    reference = PagedHarness(smollm_dequantized.model).step([long_prompt], [0], [[]])
    # NOTE: float32 summation order alone moves these 30 layers' logits by up to ~3e-3: once the process may use
    # AMX, torch's prefill attention takes one of two orders (bench/results/cpu-2026-11-27/README.md). A wrong
    # block, scale or min moves them by far more.
    torch.testing.assert_close(logits, reference, rtol=1e-3, atol=1e-2)


def _short_steps_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of three short steps: the prompts' first 8 tokens together; one decode each; then the first
    sequence's decode beside a 5-token chunk of the second's prompt after its cached prefix (a mixed step)."""
    harness = PagedHarness(model, num_blocks=64, block_size=16)
    tables = [[] for _ in prompts]
    first = harness.step([p[:8] for p in prompts], [0] * len(prompts), tables)
    decode = harness.step([[int(row.argmax())] for row in first], [8] * len(prompts), tables)
    mixed = harness.step([[int(decode[0].argmax())], prompts[1][8:13]], [9, 9], tables[:2])
    return [first, decode, mixed]


def test_short_prompts_and_mixed_steps_run_in_cpp_layers(smollm, smollm_prompts, monkeypatch):
    """Short steps with prompt tokens (fresh prompts, a chunk after a cached prefix, decodes beside it) run in
    the C++ layers as one query row a token: the eager layers' logits up to float32 summation order (their
    prompts attend through SDPA), and the same greedy tokens."""
    fast = smollm.model.stack.cpu_decode_layers
    calls = []
    monkeypatch.setattr(fast, "forward",
                        lambda *args: calls.append(args[0].shape[0]) or type(fast).forward(fast, *args))
    prompts = [p for p in smollm_prompts if len(p) >= 13][:3]
    got = _short_steps_logits(smollm.model, prompts)
    assert calls == [24, 3, 6]
    monkeypatch.setattr(smollm.model.stack, "cpu_decode_layers", None)
    expected = _short_steps_logits(smollm.model, prompts)
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2, msg=lambda m, step=step: f"step {step}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step


def _long_steps_logits(model, tokens: list[int]) -> list[torch.Tensor]:
    """Logits of two long steps: a 100-token prompt beside another's first 8 tokens (108 rows: two of the AMX
    path's 64-token passes); then the first sequence's decode beside a 70-token chunk of the second's."""
    harness = PagedHarness(model, num_blocks=64, block_size=16)
    tables = [[], []]
    first = harness.step([tokens[:100], tokens[100:108]], [0, 0], tables)
    mixed = harness.step([[int(first[0].argmax())], tokens[108:178]], [100, 8], tables)
    return [first, mixed]


def test_long_steps_run_in_cpp_layers_where_amx_runs_the_matmuls(smollm, smollm_prompts, monkeypatch):
    """Where AMX runs the quantized matmuls at any row count, steps of any length take the C++ layers (faster
    than the eager ones however long, see cpu_decode.py), with the eager layers' logits up to summation order;
    elsewhere, past MAX_QUANTIZED_MATMUL_ROWS rows, the eager layers (dense BLAS)."""
    fast = smollm.model.stack.cpu_decode_layers
    calls = []
    monkeypatch.setattr(fast, "forward",
                        lambda *args: calls.append(args[0].shape[0]) or type(fast).forward(fast, *args))
    tokens = [t for ids in smollm_prompts for t in ids]
    assert len(tokens) >= 178
    got = _long_steps_logits(smollm.model, tokens)
    assert calls == ([108, 71] if EXTENSION.instruction_set() == "amx" else [])
    monkeypatch.setattr(smollm.model.stack, "cpu_decode_layers", None)
    expected = _long_steps_logits(smollm.model, tokens)
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2, msg=lambda m, step=step: f"step {step}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step


def test_float16_kv_cache_decodes_the_float32_caches_tokens(smollm, smollm_prompts, monkeypatch):
    """`--kv-cache-dtype fp16` on the embedded model: its steps still take the C++ layers, and rounding the
    cached keys and values to float16 leaves these prompts' greedy tokens those of the float32 cache."""
    fast = smollm.model.stack.cpu_decode_layers
    calls = []
    monkeypatch.setattr(fast, "forward", lambda *args: calls.append(1) or type(fast).forward(fast, *args))
    prompts = smollm_prompts[:6]
    got = PagedHarness(smollm.model, num_blocks=128, block_size=16, cache_dtype=torch.float16).generate(prompts, 32)
    assert len(calls) == 31 + (EXTENSION.instruction_set() == "amx")  # every decode step (and with AMX the prefill)
    expected = PagedHarness(smollm.model, num_blocks=128, block_size=16).generate(prompts, 32)
    assert got == expected


def test_concurrent_callers_get_their_own_results():
    """The kernels' worker pool serves several calling threads (the engine loop, an embedding thread)."""
    import threading

    rng = np.random.default_rng()
    weight = QuantizedWeight.from_gguf_blocks(random_blocks(QuantType.Q4_1, 300, 256, rng), QuantType.Q4_1)
    inputs = [torch.randn(1 + i % 5, 256) for i in range(8)]
    expected = [quant_matmul_ref(x, weight) for x in inputs]
    results: dict[int, torch.Tensor] = {}

    def call(i: int) -> None:
        for _ in range(20):
            results[i] = quant_matmul(inputs[i], weight)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for i, x in enumerate(inputs):
        torch.testing.assert_close(results[i].double(), expected[i], rtol=1e-5, atol=1e-5)


def _decode_logits(model, prompts: list[list[int]], num_steps: int) -> list[torch.Tensor]:
    """Logits [len(prompts), V] of each greedy decode step after prefilling `prompts` together."""
    harness = PagedHarness(model, num_blocks=128, block_size=16)
    tables = [[] for _ in prompts]
    logits = harness.step(prompts, [0] * len(prompts), tables)
    cached, steps = [len(p) for p in prompts], []
    for _ in range(num_steps):
        logits = harness.step([[int(row.argmax())] for row in logits], cached, tables)
        cached = [c + 1 for c in cached]
        steps.append(logits)
    return steps


def test_decode_steps_run_in_cpp_layers_with_the_eager_layers_logits(smollm, smollm_prompts, monkeypatch):
    """The packed model's decode steps go through the C++ layers (`model/cpu_decode.py`), which run the
    eager layers' kernels in their order: the logits are the eager layers' bit for bit."""
    stack = smollm.model.stack
    fast = stack.cpu_decode_layers
    assert fast is not None, "the embedded model qualifies for the C++ decode layers"
    calls = []
    monkeypatch.setattr(fast, "forward", lambda *args: calls.append(1) or type(fast).forward(fast, *args))
    prompts = smollm_prompts[:3]
    # The prefill runs eagerly in both runs (with AMX it would take the C++ layers too, whose prompt rows attend
    # through the decode kernel: the same cache up to summation order, not bit for bit).
    monkeypatch.setattr(fast, "takes", lambda num_tokens, kv_caches: num_tokens == len(prompts))
    got = _decode_logits(smollm.model, prompts, 6)
    assert len(calls) == 6  # every decode step
    monkeypatch.setattr(stack, "cpu_decode_layers", None)
    expected = _decode_logits(smollm.model, prompts, 6)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"decode step {step} differs by {(a - b).abs().max()}"
