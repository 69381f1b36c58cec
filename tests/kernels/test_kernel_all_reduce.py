"""The one-shot all-reduce kernel on one rank, its peers played by the test: what the peers would have
stored into this rank's buffer and flags is written by hand, so one process checks the protocol (which half, which
flag, which count) and the sum. On two GPUs it runs for real in bench/gpu_tp.py's allreduce case."""

import pytest
import torch

from kernels.all_reduce import BLOCK, OneShotCollectives
from tests.kernels.kernel_testlib import DEVICE, ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="peers simulated in host-visible memory: interpreter only")

MAX_BYTES = 4 * BLOCK * 4  # four programs of fp32, eight of bf16


class SimulatedGroup:
    """`world_size` ranks' buffers and flags in this process; `reducer(rank)` runs that rank's kernel."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        num_bytes = OneShotCollectives.buffer_bytes(MAX_BYTES, world_size)
        self.data = [torch.zeros(num_bytes, dtype=torch.uint8, device=DEVICE) for _ in range(world_size)]
        self.flags = [torch.zeros(OneShotCollectives.flag_count(MAX_BYTES, world_size), dtype=torch.int32,
                                  device=DEVICE) for _ in range(world_size)]

    def reducer(self, rank: int) -> OneShotCollectives:
        return OneShotCollectives(rank, self.world_size, [d.data_ptr() for d in self.data],
                                  [f.data_ptr() for f in self.flags], MAX_BYTES, DEVICE)

    def slot(self, owner: int, source: int, call: int, dtype: torch.dtype) -> torch.Tensor:
        """Where call number `call` (1, 2, ...) of rank `source` puts its addend in rank `owner`'s buffer."""
        return self.data[owner].view(dtype).view(2, self.world_size, -1)[call % 2, source]

    def peer_arrives(self, peer: int, call: int, x: torch.Tensor | None, num_programs: int) -> None:
        """What `peer`'s kernel would have done by its flag stores: its data (if it pushes: None for a
        broadcast's receiver) and its flags in every other rank's buffer and flags."""
        for rank in range(self.world_size):
            if rank != peer:
                if x is not None:
                    self.slot(rank, peer, call, x.dtype)[: x.numel()] = x.view(-1)
                self.flags[rank].view(-1, self.world_size)[:num_programs, peer] = call


def _addends(world_size: int, num_elems: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_elems, generator=gen).to(dtype).to(DEVICE) for _ in range(world_size)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_elems", [8, 3000])  # one program (masked) and three, the last partial
def test_sum_of_every_rank_in_rank_order(dtype, num_elems):
    group = SimulatedGroup(world_size=3)
    addends = _addends(3, num_elems, dtype, seed=num_elems)
    num_programs = -(-num_elems // BLOCK)
    for peer in (0, 2):
        group.peer_arrives(peer, call=1, x=addends[peer], num_programs=num_programs)

    out = group.reducer(rank=1)(addends[1])

    expected = ((addends[0].float() + addends[1].float()) + addends[2].float()).to(dtype)
    assert torch.equal(out, expected)
    # Its addend went into its slot of call 1's half of both peers' buffers, and it flagged call 1 to both.
    for peer in (0, 2):
        assert torch.equal(group.slot(peer, 1, 1, dtype)[:num_elems], addends[1])
        flags = group.flags[peer].view(-1, 3)
        assert flags[:num_programs, 1].tolist() == [1] * num_programs
        assert flags[num_programs:, 1].eq(0).all()  # programs that did not run flagged nothing


def test_calls_alternate_halves_and_count_per_program():
    group = SimulatedGroup(world_size=2)
    rank0 = group.reducer(rank=0)
    for call, num_elems in [(1, 2 * BLOCK), (2, 2 * BLOCK), (3, 2 * BLOCK)]:
        x0, x1 = _addends(2, num_elems, torch.bfloat16, seed=call)
        group.peer_arrives(1, call, x1, num_programs=2)
        out = rank0(x0)
        assert torch.equal(out, (x0.float() + x1.float()).to(torch.bfloat16)), f"call {call}"
        assert torch.equal(group.slot(1, 0, call, torch.bfloat16)[:num_elems], x0)
        assert group.flags[1].view(-1, 2)[:, 0].tolist() == [call, call] + [0] * 6
    assert rank0.calls.tolist() == [3, 3] + [0] * 6
    # The peer's halves hold calls 2 and 3: call 3 did not overwrite what the peer read in call 2.
    assert torch.equal(group.slot(1, 0, 2, torch.bfloat16)[:2 * BLOCK], _addends(2, 2 * BLOCK, torch.bfloat16, 2)[0])


def test_a_peer_already_a_call_ahead_counts_as_arrived():
    group = SimulatedGroup(world_size=2)
    x0, x1 = _addends(2, BLOCK, torch.bfloat16, seed=7)
    group.peer_arrives(1, call=1, x=x1, num_programs=1)
    group.flags[0].view(-1, 2)[0, 1] = 2  # the peer went on to call 2 before this rank looked
    out = group.reducer(rank=0)(x0)
    assert torch.equal(out, (x0.float() + x1.float()).to(torch.bfloat16))


def test_broadcast_root_pushes_to_every_peer_and_keeps_its_tensor():
    group = SimulatedGroup(world_size=3)
    slots = torch.arange(1500, dtype=torch.int64) * 3_000_000_007  # int64 beyond 32 bits: moved as words
    for peer in (1, 2):
        group.peer_arrives(peer, call=1, x=None, num_programs=3)  # 3000 words: three programs

    assert group.reducer(rank=0).broadcast(slots) is slots

    assert torch.equal(slots, torch.arange(1500, dtype=torch.int64) * 3_000_000_007)
    for peer in (1, 2):
        assert torch.equal(group.slot(peer, 0, 1, torch.int64)[:1500], slots)
        assert group.flags[peer].view(-1, 3)[:3, 0].tolist() == [1, 1, 1]


def test_broadcast_receiver_takes_rank_0s_data_and_counts_calls_with_the_all_reduces():
    group = SimulatedGroup(world_size=2)
    rank1 = group.reducer(rank=1)
    x0, x1 = _addends(2, 16, torch.float32, seed=3)
    group.peer_arrives(0, call=1, x=x0, num_programs=1)
    rank1(x1)  # an all-reduce: call 1 of program 0
    root_tokens = torch.tensor([7, -1, 2**40, 5], dtype=torch.int64)
    group.peer_arrives(0, call=2, x=root_tokens, num_programs=1)  # rank 0 pushes into slot 0 of half 0
    tokens = torch.zeros(4, dtype=torch.int64)

    rank1.broadcast(tokens)

    assert tokens.tolist() == [7, -1, 2**40, 5]
    assert rank1.calls[0].item() == 2
    assert group.flags[0].view(-1, 2)[0, 1].item() == 2


def test_an_empty_tensor_is_no_call():
    reducer = SimulatedGroup(world_size=2).reducer(rank=1)
    reducer.broadcast(torch.zeros(0, dtype=torch.int64))
    reducer(torch.zeros(0, dtype=torch.bfloat16))
    assert reducer.calls.eq(0).all()  # nothing waited for a peer: the peers skip it alike


def test_rejects_what_the_buffer_cannot_hold():
    reducer = SimulatedGroup(world_size=2).reducer(rank=0)
    with pytest.raises(ValueError, match="at most 16384 bytes"):
        reducer(torch.zeros(MAX_BYTES // 2 + 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16- or 32-bit floats"):
        reducer(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="16- or 32-bit floats"):
        reducer(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        reducer.broadcast(torch.zeros(3, dtype=torch.int16))
