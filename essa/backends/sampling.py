"""Sampling under common random numbers: the same uniform draws for every candidate.

ES ranks candidates by fitness; with temperature > 0 each completion is a random draw, and
independent draws per candidate add noise that has nothing to do with the parameters. Under
common random numbers (CRN) the j-th sample of prompt i uses the same random stream for every
candidate and on every rank, so two identical candidates produce identical samples and two
similar ones mostly agree; only the parameters separate them.

The draw: at decoding step t, row r takes one uniform ``u = U(seed_r, t)`` from a counter-based
hash (SplitMix64 of the row's seed and the step, computed on the device, no generator state),
and picks the token by inverse CDF over the vocabulary in token-id order:
``y_t = min{v : sum_{w <= v} p(w) > u}`` with ``p = softmax(top_p(logits / T))``. This is an
exact sample from ``p`` (the usual temperature and nucleus semantics, as in HF's warpers), and
a fixed ``u`` maps close distributions to the same token with high probability. A row's draws
depend only on its seed and the step, so dropping finished rows from a batch, splitting rows
into micro-batches or across ranks, or reordering candidates never changes a sample.
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch arithmetic wraps around."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic), elementwise."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def row_seed(seed: int, prompt: int, sample: int) -> int:
    """The stream of sample ``sample`` of prompt ``prompt`` of a call seeded ``seed``.

    A pure function of its arguments: the same for every candidate and every rank.
    """
    x = torch.tensor([_signed(seed)], dtype=torch.int64)
    for part in (prompt, sample):
        x = splitmix64(x ^ _signed(part))
    return int(x.item())


def uniforms(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """(b,) float64 in [0, 1): the draw of each row's stream at decoding ``step``."""
    x = splitmix64(seeds ^ _signed(step * _GOLDEN))
    return _shr(x, 11).to(torch.float64) * 2.0**-53


def warp(scores: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Temperature, then nucleus (top-p) filtering, as HF's warpers do: (b, V) float32."""
    scores = scores.float() / temperature
    if top_p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = False  # keep at least the most likely token
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def crn_sample(
    scores: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_p: float
) -> torch.Tensor:
    """(b,) tokens: inverse-CDF draws of ``softmax(warp(scores))`` with the rows' CRN uniforms.

    ``seeds`` (b,) int64 are the rows' streams (:func:`row_seed`), on ``scores``' device.
    """
    probs = warp(scores, temperature, top_p).softmax(dim=-1).double()  # (b, V)
    cdf = probs.cumsum(dim=-1)  # (b, V)
    u = uniforms(seeds, step).to(cdf.device)[:, None] * cdf[:, -1:]  # (b, 1): rounding-safe
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1)  # first v with cdf[v] > u
    return tokens.clamp_(max=scores.shape[-1] - 1)


class RowPicker:
    """Picks each running row's next token and, when asked, records its log-probability.

    Greedy (``temperature == 0``): argmax of the processed scores, as ``generate``. Sampling with
    ``seeds`` (N,) int64: :func:`crn_sample` with row r's own stream, wherever r sits in the batch.
    The recorded log-prob is that of the raw model distribution, ``log softmax(logits)[y_t]``
    (vLLM's default ``raw_logprobs``), one per generated token, the stop token included.
    """

    def __init__(
        self,
        n_rows: int,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seeds: torch.Tensor | None = None,
        record_logprobs: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.seeds = None if seeds is None else seeds.to(device or "cpu")  # (N,) int64
        self.logprobs = (
            torch.zeros(n_rows, max_new_tokens, dtype=torch.float32, device=device)
            if record_logprobs
            else None
        )  # (N, T_new)

    @property
    def samples(self) -> bool:
        return self.temperature > 0

    def pick(
        self, logits: torch.Tensor, scores: torch.Tensor, origin: torch.Tensor, step: int
    ) -> torch.Tensor:
        """(b,) next tokens of rows ``origin`` (b,) from raw ``logits`` and processed ``scores``."""
        if not self.samples:
            tokens = torch.argmax(scores, dim=-1)
        else:
            if self.seeds is None:
                raise ValueError("sampling with RowPicker needs the rows' seeds")
            seeds = self.seeds.index_select(0, origin.to(self.seeds.device))
            tokens = crn_sample(scores, seeds.to(scores.device), step, self.temperature, self.top_p)
        if self.logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, None])  # (b, 1)
            self.logprobs[origin.to(self.logprobs.device), step] = logp.squeeze(1)
        return tokens

    def row_logprobs(self, lengths: list[int]) -> list[list[float]]:
        """Per row, the log-probs of its first ``lengths[r]`` generated tokens."""
        if self.logprobs is None:
            return [[] for _ in lengths]
        host = self.logprobs.cpu()
        return [host[r, :n].tolist() for r, n in enumerate(lengths)]
