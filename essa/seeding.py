"""Every random stream of a run: a seed, the stream's domain, and where in the run a draw is.

A draw is a pure function of ``(seed, domain, *keys)``. The keys say where in the run it
happens (generation, step, prompt, candidate, sample), never how many draws came before, so one
rank draws what N ranks do, a resumed run draws what the uninterrupted one did, and no
generator state needs a checkpoint.

The stream is ``SeedSequence([seed, tag, *keys])``, ``tag`` the domain's number in
:data:`DOMAINS`. Tags are distinct, so no two domains share a stream. Within a run a domain
always takes the same number of keys: numpy pads entropy shorter than four words with zeros,
so ``[s, t]`` and ``[s, t, 0]`` are one stream.

Tags 1-31 are the derivations the streams had before this module, and tag 0 makes
``[seed, 0]``, which numpy's padding turns into the bare ``SeedSequence(seed)`` the first ES
optimizer always drew from: tests and archived runs pin their draws (the demo's adapter bytes,
bit-exact resumes, the selection order). Newer streams take tags from 101 on.

An ES optimizer names its own streams and tags in its module; the optimizer registry
(:func:`essa.optimizers.register`) adds them here with :func:`register_domains`, which refuses
a name or tag that another stream holds.

Sampled decoding has its own counter-based streams (:mod:`essa.backends.sampling`), seeded per
call by the recipes (ESSA: ``run.seed * 100_003 + generation``; GRPO and DPO: from their
``*.sampling`` domains below).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

DOMAINS: dict[str, int] = {
    "sft.batches": 1,  # SFT example order (LoRA, full and LISA)
    "es.minibatch": 2,  # ESSA's shared prompts of a generation (keys: generation)
    "es.scale_baseline": 3,  # the no-search baseline's training prompts
    "layerwise.schedule": 5,  # layers active per interval, layerwise ES and LISA (keys: interval)
    "layerwise.block_seed": 6,  # each layerwise block's inner-optimizer seed (keys: block)
    "data.test_split": 7,  # held-out cut of a file or hub dataset
    "data.sft_split": 8,  # SFT / training cut
    "grpo.prompts": 9,  # keys: step, sampling round
    "grpo.sampling": 10,  # the round's decoding seed (keys: step, round)
    "grpo.replay": 11,  # replayed successes (keys: step, round)
    "dpo.prompts": 12,  # online pairs' prompts (keys: step)
    "dpo.sampling": 13,  # keys: step
    "scalebio.batches": 14,  # keys: step, stream
    "selection.refill": 31,  # GRESO's refill order and skips (keys: generation, or step, round)
    "dpo.file_pairs": 101,  # pairs drawn from dpo.pairs (keys: step)
    "cure.critical": 103,  # critical-token choice (seed: the round's decoding seed)
    "cure.branches": 104,  # the branches' decoding seed (seed: the round's decoding seed)
    "reward.random": 105,  # the random reward's Bernoulli draws (keys: an item's draw key)
    "reward.noisy": 106,  # the noisy reward's flips (keys: a group's draw key)
    "drift.samples": 107,  # the final report's pass@K samples (keys: none)
    "tools.turn": 108,  # a GRPO rollout's turns after the first (keys: the turn)
    "es.signal": 109,  # the signal's random half-splits of a generation's prompts (keys: generation)
}


def register_domains(domains: Mapping[str, int]) -> None:
    """Add a component's own streams (domain -> tag); registering the same pair again is a no-op.

    >>> register_domains({"es.minibatch": 2})
    """
    taken = {tag: name for name, tag in DOMAINS.items()}
    for name, tag in domains.items():
        if DOMAINS.get(name, tag) != tag or taken.get(tag, name) != name:
            raise ValueError(
                f"seed domain {name!r} -> {tag}: the name or the tag is taken "
                f"({name!r} -> {DOMAINS.get(name)}, tag {tag} -> {taken.get(tag)!r})"
            )
        taken[tag] = name
    DOMAINS.update(domains)


def seed_sequence(seed: int, domain: str, *keys: int) -> np.random.SeedSequence:
    """The stream of ``domain`` at ``keys`` under ``seed`` (all non-negative integers).

    >>> seed_sequence(0, "es.minibatch", 3).entropy
    [0, 2, 3]
    """
    return np.random.SeedSequence([seed, DOMAINS[domain], *keys])


def rng(seed: int, domain: str, *keys: int) -> np.random.Generator:
    """A generator on the stream of ``domain`` at ``keys`` (see :func:`seed_sequence`)."""
    return np.random.default_rng(seed_sequence(seed, domain, *keys))


def seed_int(seed: int, domain: str, *keys: int) -> int:
    """A 32-bit seed from the stream of ``domain`` at ``keys``, for code that takes an int."""
    return int(seed_sequence(seed, domain, *keys).generate_state(1)[0])
