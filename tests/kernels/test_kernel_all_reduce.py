"""The one-shot all-reduce kernel on one rank, its peers played by the test: what the peers would have
stored into this rank's buffer (each 32-bit word paired with the call's number) is written by hand, so one
process checks the protocol (which half, which slot, which call number) and the sum. On two GPUs it runs for
real in bench/gpu_tp.py's allreduce case."""

import threading
import time

import pytest
import torch

from kernels.all_reduce import BLOCK, OneShotCollectives
from tests.kernels.kernel_testlib import DEVICE, ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="peers simulated in host-visible memory: interpreter only")

MAX_BYTES = 4 * BLOCK * 4  # four programs of 32-bit words


def _words(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.int32)


class SimulatedGroup:
    """`world_size` ranks' buffers in this process; `reducer(rank)` runs that rank's kernel."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        num_bytes = OneShotCollectives.buffer_bytes(MAX_BYTES, world_size)
        self.data = [torch.zeros(num_bytes, dtype=torch.uint8, device=DEVICE) for _ in range(world_size)]

    def reducer(self, rank: int) -> OneShotCollectives:
        return OneShotCollectives(rank, self.world_size, [d.data_ptr() for d in self.data], MAX_BYTES, DEVICE)

    def slot(self, owner: int, source: int, call: int) -> torch.Tensor:
        """int64 pairs where call number `call` (1, 2, ...) of rank `source` puts its words in rank `owner`'s
        buffer."""
        return self.data[owner].view(torch.int64).view(2, self.world_size, -1)[call % 2, source]

    def peer_arrives(self, peer: int, call: int, x: torch.Tensor) -> None:
        """What `peer`'s kernel stores into every other rank's buffer: its words, each with the call number."""
        pairs = (call << 32) | (_words(x).to(torch.int64) & 0xFFFFFFFF)
        for rank in range(self.world_size):
            if rank != peer:
                self.slot(rank, peer, call)[: pairs.numel()] = pairs

    def pushed(self, owner: int, source: int, call: int, num_words: int) -> tuple[list[int], torch.Tensor]:
        """(the call numbers, the words) `source` stored in `owner`'s buffer for `call`."""
        pairs = self.slot(owner, source, call)[:num_words]
        return (pairs >> 32).tolist(), (pairs & 0xFFFFFFFF).to(torch.int32)


def _addends(world_size: int, num_elems: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_elems, generator=gen).to(dtype).to(DEVICE) for _ in range(world_size)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("num_elems", [8, 1800])  # one program (masked), and several with the last partial
def test_sum_of_every_rank_in_rank_order(dtype, num_elems):
    group = SimulatedGroup(world_size=3)
    addends = _addends(3, num_elems, dtype, seed=num_elems)
    for peer in (0, 2):
        group.peer_arrives(peer, call=1, x=addends[peer])

    out = group.reducer(rank=1)(addends[1])

    expected = ((addends[0].float() + addends[1].float()) + addends[2].float()).to(dtype)
    assert torch.equal(out, expected)
    # Its words went into its slot of call 1's half of both peers' buffers, each paired with call number 1.
    num_words = _words(addends[1]).numel()
    for peer in (0, 2):
        calls, words = group.pushed(peer, 1, 1, num_words)
        assert calls == [1] * num_words
        assert torch.equal(words, _words(addends[1]))
        assert group.slot(peer, 1, 1)[num_words:].eq(0).all()  # nothing past the tensor


def test_bf16_sums_round_to_nearest_even():
    group = SimulatedGroup(world_size=2)
    # 1 + 2**-8 lies halfway between bf16's 1 and 1 + 2**-7: even (1) wins; 1 + 3 * 2**-8 goes up to 1 + 2**-6.
    x0 = torch.tensor([1.0, 1.0, -1.0, 0.5], dtype=torch.bfloat16)
    x1 = torch.tensor([2**-8, 3 * 2**-8, -(2**-8), 0.25], dtype=torch.float32).to(torch.bfloat16)
    group.peer_arrives(1, call=1, x=x1)
    out = group.reducer(rank=0)(x0)
    assert out.float().tolist() == [1.0, 1.0 + 2**-6, -1.0, 0.75]


def test_calls_alternate_halves_and_count_per_program():
    group = SimulatedGroup(world_size=2)
    rank0 = group.reducer(rank=0)
    for call in (1, 2, 3):
        x0, x1 = _addends(2, 4 * BLOCK, torch.bfloat16, seed=call)  # two programs of words
        group.peer_arrives(1, call, x1)
        out = rank0(x0)
        assert torch.equal(out, (x0.float() + x1.float()).to(torch.bfloat16)), f"call {call}"
        calls, words = group.pushed(1, 0, call, 2 * BLOCK)
        assert calls == [call] * (2 * BLOCK) and torch.equal(words, _words(x0))
    assert rank0.calls.tolist() == [3, 3, 0, 0]
    # The peer's halves hold calls 2 and 3: call 3 did not overwrite what the peer read in call 2.
    assert torch.equal(group.pushed(1, 0, 2, 2 * BLOCK)[1], _words(_addends(2, 4 * BLOCK, torch.bfloat16, 2)[0]))


def test_a_peer_already_a_call_ahead_leaves_this_call_in_place():
    group = SimulatedGroup(world_size=2)
    x0, x1 = _addends(2, BLOCK, torch.bfloat16, seed=7)
    group.peer_arrives(1, call=1, x=x1)
    group.peer_arrives(1, call=2, x=torch.full((BLOCK,), 5.0, dtype=torch.bfloat16))  # the other half
    out = group.reducer(rank=0)(x0)
    assert torch.equal(out, (x0.float() + x1.float()).to(torch.bfloat16))


def test_waits_for_every_word_of_the_call():
    """Words of an older call in the half (call - 2) are not this call's: the kernel spins until the peer's
    words of this call are all there, however late they come."""
    group = SimulatedGroup(world_size=2)
    rank0 = group.reducer(rank=0)
    rank0.calls.fill_(2)  # this is call 3 of its program: half 1, where call 1's words lie
    x0, x1 = _addends(2, 64, torch.float32, seed=11)
    group.peer_arrives(1, call=1, x=torch.full((64,), 100.0))

    def peer() -> None:
        time.sleep(0.3)
        pairs = (3 << 32) | (_words(x1).to(torch.int64) & 0xFFFFFFFF)
        group.slot(0, 1, 3)[32:64] = pairs[32:]  # the last words first: still not the whole call
        time.sleep(0.3)
        group.slot(0, 1, 3)[:32] = pairs[:32]

    writer = threading.Thread(target=peer)
    writer.start()
    out = rank0(x0)
    writer.join()
    assert torch.equal(out, x0 + x1)


def test_broadcast_root_pushes_to_every_peer_waits_for_theirs_and_keeps_its_tensor():
    group = SimulatedGroup(world_size=3)
    slots = torch.arange(1000, dtype=torch.int64) * 3_000_000_007  # int64 beyond 32 bits: moved as words
    for peer in (1, 2):
        group.peer_arrives(peer, call=1, x=torch.zeros(1000, dtype=torch.int64))  # receivers push too

    assert group.reducer(rank=0).broadcast(slots) is slots

    assert torch.equal(slots, torch.arange(1000, dtype=torch.int64) * 3_000_000_007)
    for peer in (1, 2):
        calls, words = group.pushed(peer, 0, 1, 2000)
        assert calls == [1] * 2000 and torch.equal(words, _words(slots))


def test_broadcast_receiver_takes_rank_0s_data_and_counts_calls_with_the_all_reduces():
    group = SimulatedGroup(world_size=2)
    rank1 = group.reducer(rank=1)
    x0, x1 = _addends(2, 16, torch.float32, seed=3)
    group.peer_arrives(0, call=1, x=x0)
    rank1(x1)  # an all-reduce: call 1 of program 0
    root_tokens = torch.tensor([7, -1, 2**40, 5], dtype=torch.int64)
    group.peer_arrives(0, call=2, x=root_tokens)  # rank 0 pushes into slot 0 of half 0
    tokens = torch.full((4,), 3, dtype=torch.int64)

    rank1.broadcast(tokens)

    assert tokens.tolist() == [7, -1, 2**40, 5]
    assert rank1.calls[0].item() == 2
    calls, words = group.pushed(0, 1, 2, 8)  # what it pushed to rank 0: its old words, call 2 (it is done with 1)
    assert calls == [2] * 8 and torch.equal(words, _words(torch.full((4,), 3, dtype=torch.int64)))


def test_an_empty_tensor_is_no_call():
    reducer = SimulatedGroup(world_size=2).reducer(rank=1)
    reducer.broadcast(torch.zeros(0, dtype=torch.int64))
    reducer(torch.zeros(0, dtype=torch.bfloat16))
    assert reducer.calls.eq(0).all()  # nothing waited for a peer: the peers skip it alike


def test_rejects_what_the_buffer_cannot_hold():
    reducer = SimulatedGroup(world_size=2).reducer(rank=0)
    with pytest.raises(ValueError, match=f"at most {MAX_BYTES} bytes"):
        reducer(torch.zeros(MAX_BYTES // 2 + 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        reducer(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16- or 32-bit floats"):
        reducer(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="16- or 32-bit floats"):
        reducer(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="whole 32-bit words"):
        reducer.broadcast(torch.zeros(3, dtype=torch.int16))
