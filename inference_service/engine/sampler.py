"""Chooses the next token for every row of a batch, each row with its own request's parameters.

Processing order (each step only runs when some row needs it)::

    raw logits ──> logprobs (log_softmax of the raw logits, rows that asked)
        │
        ├─ logits processors (logits_processors.ORDER): format mask ─> logit_bias ─> min_tokens mask
        │                                               ─> repetition penalty ─> frequency/presence penalties
        │
        ├─ greedy rows:  argmax
        └─ sampled rows: / temperature ─> top-k ─> top-p ─> min-p ─> softmax ─> argmax(probs / Exp(1) noise)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.cpu_kernels.build import cpu_ops_for
from inference_service.engine.logits_processors import LogitsProcessor, apply_processors
from inference_service.engine.transfer import HostCopy, to_device

# Exponential noise of exactly 0 would divide by zero; any tiny positive floor is unbiased enough.
_MIN_NOISE = 1e-20
_ARGMAX_CHUNK = 256


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a contiguous [N, V] tensor: [N] int64, the first maximum of each row.

    NOTE: argmax over a long row is slow on both devices: on the CPU it runs an order of magnitude
    slower than a max reduction (~0.4 ms for 16 rows of a 49k vocabulary), and on a GPU a few rows get
    one thread block each (~27 us for one 128k row on an H100). The max of every 256-wide chunk, then
    argmax over those maxima and within the winning chunk, is several times faster and picks the same
    index: the first chunk holding the maximum holds its first occurrence (NaN counts as the maximum
    in both). On a GPU, float32 rows go to the one-launch Triton argmax (`kernels/argmax.py`: this took six
    small launches a step); on the CPU to the CPU kernels' argmax (`cpu_kernels/argmax.cpp` says why) where
    the extension is built."""
    num_rows, vocab = x.shape
    if x.device.type == "cuda" and x.dtype == torch.float32 and x.stride(-1) == 1 and vocab:
        from kernels.argmax import argmax_rows as triton_argmax_rows  # noqa: PLC0415 - Triton on GPUs only

        return triton_argmax_rows(x)
    cpu_ops = cpu_ops_for(x)
    if cpu_ops is not None and x.is_contiguous() and vocab:
        return cpu_ops.argmax_rows(x)
    if vocab % _ARGMAX_CHUNK or not x.is_contiguous() or (x.device.type != "cpu" and num_rows > 16):
        return x.argmax(dim=-1)
    chunks = x.view(num_rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)  # [N, V / C, C]
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [N]
    within = chunks[torch.arange(num_rows, device=x.device), best_chunk].argmax(dim=-1)  # [N]
    return best_chunk * _ARGMAX_CHUNK + within


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `SamplingParams.seed` (None when unseeded)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class Selection:
    """What the rows drawn at random are drawn with (the other rows take the argmax)."""

    rows: list[int]  # [S] batch rows drawn at random
    row_ids: torch.Tensor | None  # [S] int64 `rows` on the device; None when every row is drawn
    temperature: torch.Tensor  # [S, 1] f32
    top_k: torch.Tensor | None  # [S] int64, 0 = off; None when no row uses top-k
    max_top_k: int  # the largest top_k (0 when none)
    top_p: torch.Tensor | None  # [S] f32; None when all are 1
    min_p: torch.Tensor | None  # [S] f32; None when all are 0
    generators: list[torch.Generator | None]  # [S]


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling inputs, row i the i-th sampling sequence. Built by `SamplingState.batch`.

    An all-greedy batch with no processors costs only an argmax."""

    num_rows: int
    processors: list[LogitsProcessor]  # in `logits_processors.ORDER`, only those some row needs
    selection: Selection | None  # None: every row greedy
    logprob_rows: list[int]  # rows that asked for logprobs
    num_top_logprobs: list[int]  # per entry of `logprob_rows`
    # (batch rows [K] or None for all, their slots [K]) whose output history gets the sampled token
    history: tuple[torch.Tensor | None, torch.Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return self.selection is None

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor runs before greedy/sampled selection."""
        return bool(self.processors)


@dataclass
class SamplerOutput:
    """The chosen token per row, with logprobs for rows that asked (None elsewhere)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]  # most likely first


class PendingSample:
    """A step's sampled tokens as device tensors, on their way to the host.

    `token_ids` can feed the next step on the GPU before `result()` has them on the host."""

    def __init__(self, token_ids: torch.Tensor, batch: SamplingBatch, chosen_logprobs: torch.Tensor | None = None,
                 top_values: torch.Tensor | None = None, top_ids: torch.Tensor | None = None):
        self.token_ids = token_ids  # [N] int64
        self._batch = batch
        # chosen [R], top values and ids [R, K] for the R rows that asked for logprobs
        self._copy = HostCopy([token_ids, chosen_logprobs, top_values, top_ids])

    def result(self) -> SamplerOutput:
        """Waits for the copies to the host (not for later GPU work) and returns the lists."""
        token_ids, chosen, top_values, top_ids = self._copy.wait()
        n, batch = len(token_ids), self._batch
        logprobs: list[float | None] = [None] * n
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * n
        for j, row in enumerate(batch.logprob_rows):
            logprobs[row] = chosen[j]
            k = batch.num_top_logprobs[j]
            top_logprobs[row] = list(zip(top_ids[j][:k], top_values[j][:k])) if k else []
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top_logprobs)


def apply_penalties_and_masks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Runs the batch's logits processors (formats, logit bias, min_tokens, penalties) in order.

    logits: [N, V] float32, a copy the caller owns (it may be modified in place); returns the
    processed logits.
    """
    return apply_processors(logits, batch.processors)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            min_p: torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor:
    """Sets the logits of tokens that top-k, then top-p, then min-p exclude to -inf.

    logits: [S, V] float32, already divided by temperature. top_k [S] (0 = off), top_p [S],
    min_p [S]; a None argument skips that filter. `max_top_k` is top_k's maximum when the caller
    knows it (reading it from a GPU tensor waits for the GPU). Returns the masked logits (a new
    tensor). Each filter becomes a per-row threshold, so tokens tied with the last survivor
    survive too.
    """
    neg_inf = float("-inf")
    num_rows, vocab_size = logits.shape
    if top_k is not None:
        # NOTE: topk of the largest k asked for instead of a full sort: a sort of [S, V] costs
        # far more than the model's last layer on CPU.
        k = top_k.clamp(max=vocab_size)  # [S], 0 = off
        k_max = min(max_top_k, vocab_size) if max_top_k is not None else int(k.max())
        if k_max > 0:
            top_values = logits.topk(k_max, dim=-1).values  # [S, k_max], descending
            kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [S, 1]
            kth = torch.where((k > 0).unsqueeze(1), kth, neg_inf)
            logits = logits.masked_fill(logits < kth, neg_inf)
    if top_p is None and min_p is None:
        return logits
    probs = logits.softmax(dim=-1)  # [S, V], top-k survivors renormalized
    if top_p is not None:
        # NOTE: whether a row's cutoff lies past the candidates is read on the host, which waits
        # for the GPU: a step with top-p rows does not overlap the next one's scheduling.
        cutoff = _top_p_cutoff(probs, top_p, min(vocab_size, _TOP_P_CANDIDATES))
        missing = torch.isnan(cutoff).squeeze(1)  # [S] rows whose cutoff lies deeper
        if bool(missing.any()):
            cutoff[missing] = _top_p_cutoff(probs[missing], top_p[missing], vocab_size)
        probs = probs.masked_fill(probs < cutoff, 0.0)
    if min_p is not None:
        # Relative to the top token, which no filter removes: renormalizing changes nothing.
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return logits.masked_fill(probs == 0.0, neg_inf)


# Top-p first looks for its cutoff among this many most likely tokens, then sorts the row.
_TOP_P_CANDIDATES = 256


def _top_p_cutoff(probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Smallest kept probability per row [S, 1]: the smallest set of most likely tokens whose
    mass reaches top_p is kept. NaN where the set is larger than `num_candidates`."""
    values = probs.topk(num_candidates, dim=-1).values  # [S, C], descending
    before = values.cumsum(dim=-1) - values  # [S, C] mass of strictly more likely candidates
    # A token stays while the mass before it is short of top_p; the first always stays. Rows
    # with top_p == 1 keep everything, even where the float cumsum rounds past 1.
    keep = (before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    keep[:, 0] = True
    num_kept = keep.sum(dim=-1, keepdim=True)  # [S, 1]
    cutoff = values.gather(1, num_kept - 1)  # [S, 1]
    found = (num_kept < num_candidates) | (num_candidates == probs.shape[1]) | (top_p >= 1.0).unsqueeze(1)
    return torch.where(found, torch.where((top_p >= 1.0).unsqueeze(1), 0.0, cutoff), float("nan"))


class Sampler:
    """`Sampler()(logits [N, V] float32, batch) -> SamplerOutput`. Never modifies `logits`.

    `sample()` is the same without waiting: it queues the work and returns a `PendingSample`.
    A row with its own `torch.Generator` draws only from it (one [V] exponential-noise vector
    per step), so a seeded request gives the same tokens whatever else is in the batch. Rows
    without one share torch's default generator.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).result()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, logits.shape
        raw_logits = logits  # [N, V]
        if batch.needs_processing:
            logits = apply_penalties_and_masks(logits.clone(), batch)

        selection = batch.selection
        if selection is None:
            token_ids = argmax_rows(logits)  # [N]
        elif selection.row_ids is None:
            token_ids = self._sample(logits, selection)  # [N], every row drawn
        else:
            token_ids = argmax_rows(logits).index_copy(0, selection.row_ids, self._sample(logits, selection))
        if not batch.logprob_rows:
            return PendingSample(token_ids, batch)
        return PendingSample(token_ids, batch, *self._logprobs(raw_logits, token_ids, batch))

    @staticmethod
    def _sample(logits: torch.Tensor, selection: Selection) -> torch.Tensor:
        """Draws one token per sampled row; returns [S] int64."""
        if selection.row_ids is not None:
            # NOTE: advanced indexing; index_select along rows is an order of magnitude slower on CPU.
            logits = logits[selection.row_ids]
        scaled = logits / selection.temperature  # [S, V]
        scaled = apply_top_k_top_p_min_p(scaled, selection.top_k, selection.top_p, selection.min_p,
                                         selection.max_top_k)
        probs = scaled.softmax(dim=-1)  # [S, V]
        # argmax(p / q) with q ~ Exp(1) picks token i with probability p_i (exponential race).
        # NOTE: -log(1 - U) is Exp(1) and is several times faster than exponential_() on CPU.
        uniform = torch.empty_like(probs)  # [S, V]
        generators = selection.generators
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            uniform.uniform_()
        else:
            for j, generator in enumerate(generators):
                if generator is not None:
                    uniform[j].uniform_(generator=generator)
            if unseeded:
                idx = to_device(unseeded, torch.long, logits.device)
                uniform[idx] = torch.rand(len(unseeded), probs.shape[1], device=probs.device)
        noise = torch.log1p(uniform.neg_()).neg_().clamp_min_(_MIN_NOISE)  # [S, V] ~ Exp(1)
        return argmax_rows(probs / noise)

    @staticmethod
    def _logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logprobs of the chosen tokens [R] and the top alternatives' values and ids [R, K]
        (None when no row asked for alternatives), from the raw logits of the R rows that asked."""
        if len(batch.logprob_rows) < batch.num_rows:
            rows = to_device(batch.logprob_rows, torch.long, raw_logits.device)
            raw_logits, token_ids = raw_logits[rows], token_ids[rows]
        log_probs = raw_logits.float().log_softmax(dim=-1)  # [R, V]
        chosen = log_probs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [R]
        max_top = max(batch.num_top_logprobs)
        if max_top == 0:
            return chosen, None, None
        top_values, top_ids = log_probs.topk(min(max_top, log_probs.shape[1]), dim=-1)  # most likely first
        return chosen, top_values, top_ids
