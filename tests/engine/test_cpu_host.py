"""The CPU engine's use of the host: its KV cache on huge pages (one zeroed arena, advised huge before first touch,
split into layers), and libgomp's spinning bounded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inference_service.config import CacheConfig
from inference_service.engine.host_memory import HUGE_PAGE_BYTES, huge_page_zeros
from inference_service.engine.kv_cache import KVCacheSpec, allocate_kv_caches

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_huge_page_zeros_is_aligned_zeroed_and_advised():
    num_bytes = 5 * HUGE_PAGE_BYTES + 12345
    buffer = huge_page_zeros(num_bytes)
    assert buffer.dtype == torch.uint8 and buffer.numel() == num_bytes and buffer.is_contiguous()
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert int(buffer.count_nonzero()) == 0
    if sys.platform.startswith("linux") and os.path.exists(THP):
        assert "hg" in vm_flags(buffer.data_ptr())  # VM_HUGEPAGE: madvise(MADV_HUGEPAGE) took
    else:
        pytest.skip("no transparent huge pages here: only the buffer itself is checked")


def test_cpu_kv_caches_are_views_of_one_huge_page_arena():
    spec = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    num_blocks, caches = allocate_kv_caches(spec, CacheConfig(kv_cache_memory_mib=1), torch.device("cpu"))
    assert num_blocks == 2**20 // spec.bytes_per_block
    tensors = [t for pair in caches for t in pair]
    assert len(tensors) == 6
    layer_bytes = num_blocks * spec.bytes_per_block // 6
    base = tensors[0].data_ptr()
    assert base % HUGE_PAGE_BYTES == 0
    for i, t in enumerate(tensors):  # k0, v0, k1, v1, ...: back to back, none overlapping
        assert t.shape == spec.block_shape(num_blocks) and t.dtype == torch.float32 and t.is_contiguous()
        assert t.data_ptr() == base + i * layer_bytes
        assert int(t.count_nonzero()) == 0
    caches[0][1].fill_(1.0)  # writing one layer's values leaves every other tensor untouched
    assert [int(t.count_nonzero()) for t in tensors] == [0, tensors[1].numel(), 0, 0, 0, 0]


@pytest.mark.parametrize("preset, expected", [(None, "10000"), ("300000", "300000")])
def test_importing_the_engine_bounds_libgomp_spinning_unless_the_user_chose(preset, expected):
    """The engine's CPU threads and libgomp's share the cores: importing the package (before torch, as the
    CLI does) sets GOMP_SPINCOUNT, and a value already in the environment is kept."""
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if preset is not None:
        env["GOMP_SPINCOUNT"] = preset
    out = subprocess.run([sys.executable, "-c", "import os, inference_service; print(os.environ['GOMP_SPINCOUNT'])"],
                         env=env, capture_output=True, text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == expected
