"""Chooses the next token for every row of a batch, each row with its own request's parameters.

Processing order (each step only runs when some row needs it)::

    raw logits ──> logprobs (log_softmax of the raw logits, rows that asked)
        │
        ├─ format mask ─> logit_bias ─> min_tokens mask ─> repetition penalty ─> frequency/presence penalties
        │
        ├─ greedy rows:  argmax
        └─ sampled rows: / temperature ─> top-k ─> top-p ─> min-p ─> softmax ─> argmax(probs / Exp(1) noise)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.structured_output import token_bitmask, unpack_bitmask
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
    in both). Many rows on a GPU fill it already and keep the single kernel."""
    num_rows, vocab = x.shape
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


def _flatten(rows: list[int], lists: list[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index [M], token id [M]) int64 tensors listing `lists[j]` for row `rows[j]`."""
    row_ids = [row for row, ids in zip(rows, lists) for _ in range(len(ids))]
    token_ids = [t for ids in lists for t in ids]
    return to_device(row_ids, torch.long, device), to_device(token_ids, torch.long, device)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step as tensors. Build with `SamplingBatch.build`.

    Optional fields are None when no row needs that step, so an all-greedy batch with no
    penalties costs only an argmax.
    """

    num_rows: int
    all_greedy: bool
    sampled_rows: list[int]  # rows drawn at random
    # --- logits processors (None = no row needs it) ---
    format_mask: tuple[torch.Tensor, torch.Tensor] | None  # rows [R], allowed tokens [R, V] bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows [M], token ids [M], values [M] f32
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # rows [M], token ids [M] to set to -inf
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # penalty [N, 1], rows [M], ids [M]
    # frequency [N, 1], presence [N, 1], rows [M], output token ids [M] (repeats counted)
    freq_presence: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # --- sampled rows only, indexed like `sampled_rows` ---
    temperature: torch.Tensor | None  # [S, 1] f32
    top_k: torch.Tensor | None  # [S] int64, 0 = off; None when no sampled row uses top-k
    max_top_k: int  # the largest top_k of a sampled row (0 when none)
    top_p: torch.Tensor | None  # [S] f32; None when all are 1
    min_p: torch.Tensor | None  # [S] f32; None when all are 0
    generators: list[torch.Generator | None]  # [S]
    # --- logprobs ---
    logprob_rows: list[int]  # rows that asked for logprobs
    num_top_logprobs: list[int]  # per entry of `logprob_rows`

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              device: torch.device | str = "cpu",
              eos_token_ids: Collection[int] | Sequence[Collection[int]] = (),
              grammars: Sequence[Any] | None = None, vocab_size: int = 0) -> SamplingBatch:
        """Turns row i's `params[i]`, token history and generator into batch tensors.

        `eos_token_ids` is either one collection shared by all rows or one per row; with
        `stop_token_ids` they are masked while a row has fewer than `min_tokens` outputs
        (EOS ids are not masked for `ignore_eos` rows, which EOS does not end). `grammars[i]` is row
        i's structured-output matcher or None; `vocab_size` is the logits width they mask.
        """
        n = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == n
        if eos_token_ids and all(isinstance(t, int) for t in eos_token_ids):
            eos_per_row = [eos_token_ids] * n
        else:
            eos_per_row = list(eos_token_ids) or [()] * n
        greedy = [p.is_greedy for p in params]
        sampled = [i for i in range(n) if not greedy[i]]

        bias_rows, bias_ids, bias_vals = [], [], []
        mask_rows, mask_lists = [], []
        rep_rows, rep_lists = [], []
        fp_rows, fp_lists = [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                for token_id, value in p.logit_bias.items():
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_vals.append(value)
            if len(output_token_ids[i]) < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(eos_per_row[i])
                if banned:
                    mask_rows.append(i)
                    mask_lists.append(sorted(banned))
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
                # NOTE: duplicates are harmless: the mask is set, not accumulated.
                rep_lists.append(list(prompt_token_ids[i]) + list(output_token_ids[i]))
            if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_token_ids[i]:
                fp_rows.append(i)
                fp_lists.append(output_token_ids[i])

        format_mask = None
        format_rows = [i for i, g in enumerate(grammars or ()) if g is not None]
        if format_rows:
            bitmask = token_bitmask([grammars[i] for i in format_rows], vocab_size).to(device)  # [R, W]
            format_mask = (to_device(format_rows, torch.long, device), unpack_bitmask(bitmask, vocab_size))
        bias = None
        if bias_rows:
            bias = (to_device(bias_rows, torch.long, device), to_device(bias_ids, torch.long, device),
                    to_device(bias_vals, torch.float32, device))
        min_tokens_mask = _flatten(mask_rows, mask_lists, device) if mask_rows else None
        repetition = None
        if rep_rows:
            penalty = to_device([[p.repetition_penalty] for p in params], torch.float32, device)
            repetition = (penalty, *_flatten(rep_rows, rep_lists, device))
        freq_presence = None
        if fp_rows:
            freq = to_device([[p.frequency_penalty] for p in params], torch.float32, device)
            pres = to_device([[p.presence_penalty] for p in params], torch.float32, device)
            freq_presence = (freq, pres, *_flatten(fp_rows, fp_lists, device))

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        if sampled:
            sp = [params[i] for i in sampled]
            temperature = to_device([[p.temperature] for p in sp], torch.float32, device)
            max_top_k = max(p.top_k for p in sp)
            if max_top_k > 0:
                top_k = to_device([p.top_k for p in sp], torch.long, device)
            if any(p.top_p < 1.0 for p in sp):
                top_p = to_device([p.top_p for p in sp], torch.float32, device)
            if any(p.min_p > 0.0 for p in sp):
                min_p = to_device([p.min_p for p in sp], torch.float32, device)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs]
        return cls(
            num_rows=n,
            all_greedy=not sampled,
            sampled_rows=sampled,
            format_mask=format_mask,
            bias=bias,
            min_tokens_mask=min_tokens_mask,
            repetition=repetition,
            freq_presence=freq_presence,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=[generators[i] for i in sampled],
            logprob_rows=logprob_rows,
            num_top_logprobs=[params[i].top_logprobs for i in logprob_rows],
        )

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor runs before greedy/sampled selection."""
        return (self.format_mask is not None or self.bias is not None or self.min_tokens_mask is not None
                or self.repetition is not None or self.freq_presence is not None)


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
    """Structured-output masks, logit bias, min_tokens masking and repetition/frequency/presence penalties.

    logits: [N, V] float32, a copy the caller owns (it may be modified in place); returns the
    processed logits.
    """
    num_rows, vocab_size = logits.shape
    if batch.format_mask is not None:
        rows, allowed = batch.format_mask  # [R], [R, V]
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if batch.bias is not None:
        rows, ids, values = batch.bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if batch.min_tokens_mask is not None:
        rows, ids = batch.min_tokens_mask
        logits[rows, ids] = float("-inf")
    if batch.repetition is not None:
        penalty, rows, ids = batch.repetition  # [N, 1], [M], [M]
        seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=logits.device)  # [N, V]
        seen[rows, ids] = True
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)  # [N, V]
        logits = torch.where(seen, penalized, logits)
    if batch.freq_presence is not None:
        freq, pres, rows, ids = batch.freq_presence
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)  # [N, V]
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        logits -= freq * counts + pres * (counts > 0).float()
    return logits


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

        token_ids = argmax_rows(logits)  # [N]
        if not batch.all_greedy:
            sampled = self._sample(logits, batch)  # [S]
            rows = to_device(batch.sampled_rows, torch.long, logits.device)
            token_ids = token_ids.index_copy(0, rows, sampled)
        if not batch.logprob_rows:
            return PendingSample(token_ids, batch)
        return PendingSample(token_ids, batch, *self._logprobs(raw_logits, token_ids, batch))

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Draws one token per sampled row; returns [S] int64."""
        if len(batch.sampled_rows) < batch.num_rows:
            # NOTE: advanced indexing; index_select along rows is an order of magnitude slower on CPU.
            logits = logits[to_device(batch.sampled_rows, torch.long, logits.device)]
        scaled = logits / batch.temperature  # [S, V]
        scaled = apply_top_k_top_p_min_p(scaled, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k)
        probs = scaled.softmax(dim=-1)  # [S, V]
        # argmax(p / q) with q ~ Exp(1) picks token i with probability p_i (exponential race).
        # NOTE: -log(1 - U) is Exp(1) and is several times faster than exponential_() on CPU.
        uniform = torch.empty_like(probs)  # [S, V]
        unseeded = [j for j, g in enumerate(batch.generators) if g is None]
        if len(unseeded) == len(batch.generators):
            uniform.uniform_()
        else:
            for j, generator in enumerate(batch.generators):
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
