"""Row-dropping decode: the same completions as HF generate, with finished rows dropped.

Runs the bundled demo model (answers of 1-3 digits then EOS; perturbed candidates write longer
or never stop), so the rows of one micro-batch end at different steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from essa.config import EvaluationConfig, GenerationConfig

QUESTIONS = ["12+3=", "7+45=", "1+1=", "99+99=", "5+60=", "3+3=", "48+51=", "0+7="]
FEW_SHOT = "1+2+3+4+5+"  # 10 shared tokens: the prefix cache applies


@pytest.fixture(scope="module")
def demo():  # type: ignore[no-untyped-def]
    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig())
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.05
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    x = np.random.default_rng(0).normal(size=(4, adapter.dim)) * adapter.stds() * 3.0
    x[0] = 0.0  # the SFT adapter itself: short, EOS-terminated answers
    return peft_model.unload(), tokenizer, adapter, x


def run(demo, monkeypatch, *, drop: bool, **options):  # type: ignore[no-untyped-def]
    """completions[candidate][prompt] and how many times rows were dropped."""
    from essa.backends import decode
    from essa.backends import generate as hf
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, x = demo
    prompts = options.pop("prompts")
    gen = GenerationConfig(max_new_tokens=options.pop("max_new_tokens", 10))
    with monkeypatch.context() as patch:
        drops: list[int] = []
        keep = decode._Running.keep

        def spy(self, kept, cache):  # type: ignore[no-untyped-def]
            drops.append(len(self.origin) - len(kept))
            keep(self, kept, cache)

        patch.setattr(decode._Running, "keep", spy)
        if not drop:
            patch.setattr(hf, "supports_row_dropping", lambda model: False)
        evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, EvaluationConfig(**options))
        out = evaluator.completions(x, prompts)
    return out, drops


@pytest.mark.parametrize("strategy", ["batched", "merged"])
@pytest.mark.parametrize("use_prefix_cache", [False, True])
@pytest.mark.parametrize("micro_batch_size", [5, 1024])
def test_completions_identical_to_generate(
    demo, monkeypatch, strategy, use_prefix_cache, micro_batch_size
) -> None:  # type: ignore[no-untyped-def]
    prompts = [FEW_SHOT + q for q in QUESTIONS] if use_prefix_cache else QUESTIONS
    options = dict(
        prompts=prompts, strategy=strategy, use_prefix_cache=use_prefix_cache,
        micro_batch_size=micro_batch_size,
    )  # fmt: skip
    dropped, drops = run(demo, monkeypatch, drop=True, **options)
    generated, none = run(demo, monkeypatch, drop=False, **options)
    assert dropped == generated
    assert drops and not none  # rows really were dropped on the way
    lengths = {len(t) for c in generated for t in c}
    assert len(lengths) >= 3, f"answers should vary in length, got {lengths}"


def test_nonfinite_rows_are_flagged_and_dropped(demo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, x = demo
    sick = x.copy()
    sick[2] = 1e30  # overflows: NaN/inf logits
    evaluator = PopulationEvaluator(
        model, tokenizer, adapter, GenerationConfig(max_new_tokens=6), EvaluationConfig()
    )
    out = evaluator.completions(sick, QUESTIONS)
    assert evaluator.nonfinite.tolist() == [False, False, True, False]
    assert out[2] == [""] * len(QUESTIONS)
    healthy = evaluator.completions(sick[[0, 1, 3]], QUESTIONS)
    assert [out[0], out[1], out[3]] == healthy


def test_sampling_is_seeded_and_stops(demo) -> None:  # type: ignore[no-untyped-def]
    """Sampling runs through the same loop: reproducible for a seed, EOS still ends rows."""
    from essa.backends.evaluator import PopulationEvaluator

    model, tokenizer, adapter, x = demo
    gen = GenerationConfig(max_new_tokens=8, temperature=0.7, top_p=0.9)
    cfg = EvaluationConfig(strategy="batched")  # auto's probes split the population
    evaluator = PopulationEvaluator(model, tokenizer, adapter, gen, cfg)
    first = evaluator.completions(x, QUESTIONS, seed=5)
    assert evaluator.completions(x, QUESTIONS, seed=5) == first
    assert any(len(t) < 8 for t in first[0])  # the SFT candidate's rows stop at EOS


@pytest.mark.parametrize("check_every", [None, 3])
def test_decode_rows_pads_like_generate(demo, check_every) -> None:  # type: ignore[no-untyped-def]
    """The raw token layout: each row up to its stop token, then padding (as generate pads).

    ``check_every=3`` is the GPU setting's shape (ended rows read back every few steps).
    """
    from essa.backends.decode import decode_rows
    from essa.backends.generate import _generate_kwargs, pad_rows

    model, tokenizer, _, _ = demo
    encoded = tokenizer(QUESTIONS, add_special_tokens=False)["input_ids"]
    ids, mask = pad_rows(encoded, 0, tokenizer.pad_token_id, torch.device("cpu"))
    kwargs = _generate_kwargs(
        GenerationConfig(max_new_tokens=6), tokenizer, [tokenizer.eos_token_id]
    )
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
    assert torch.equal(decode_rows(model, ids, mask, kwargs, check_every=check_every), expected)


def test_peft_wrapped_models_keep_generate(demo) -> None:  # type: ignore[no-untyped-def]
    """A PeftModel's forward takes **kwargs: the loop could not know its arguments arrive."""
    import copy

    from essa.backends.decode import supports_row_dropping
    from essa.config import AdapterConfig
    from essa.gradient.sft import make_lora_model

    model = demo[0]
    assert supports_row_dropping(model)
    assert not supports_row_dropping(make_lora_model(copy.deepcopy(model), AdapterConfig(rank=2)))


def generate(demo, monkeypatch, gen: GenerationConfig, *, drop: bool = True, **options):  # type: ignore[no-untyped-def]
    """generate_texts on the plain demo model: the decode loop, or generate (``drop=False``)."""
    from essa.backends import generate as hf

    model, tokenizer, _, _ = demo
    with monkeypatch.context() as patch:
        if not drop:
            patch.setattr(hf, "supports_row_dropping", lambda model: False)
        texts, _ = hf.generate_texts(model, tokenizer, QUESTIONS, gen, **options)
    return texts


def raw_logprobs(demo, texts: list[str], lengths: list[int]) -> list[list[float]]:  # type: ignore[no-untyped-def]
    """The model's own log-probs of each row's generated tokens (its stop token included when
    ``lengths`` counts it), teacher-forced in one plain forward: no processor, no picker."""
    from essa.backends.teacher import token_logprobs_rows

    model, tokenizer, _, _ = demo
    prompts = tokenizer(QUESTIONS, add_special_tokens=False)["input_ids"]
    completions = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pairs = []
    for prompt, ids, length in zip(prompts, completions, lengths, strict=True):
        assert length in (len(ids), len(ids) + 1)  # the demo's tokenizer is one char a token
        pairs.append((list(prompt), list(ids) + [tokenizer.eos_token_id] * (length - len(ids))))
    return token_logprobs_rows(model, pairs, pad_id=tokenizer.pad_token_id, micro_batch_size=64)


def assert_logprobs_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert [len(row) for row in got] == [len(row) for row in want]
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("drop", [True, False])
def test_logprobs_are_the_models_own_with_a_repetition_penalty(demo, monkeypatch, drop) -> None:  # type: ignore[no-untyped-def]
    """The model's generation config penalises repeats (its processors change the scores): the
    decode loop and the generate fallback both record log-probs of the raw distribution."""
    model = demo[0]
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 3.0)
    gen = GenerationConfig(max_new_tokens=6)
    logprobs: list[list[float]] = []
    texts = generate(demo, monkeypatch, gen, drop=drop, micro_batch_size=8, logprobs=logprobs)
    plain = generate(demo, monkeypatch, gen, drop=drop, micro_batch_size=8)
    assert texts == plain  # recording changes no token
    monkeypatch.setattr(model.generation_config, "repetition_penalty", 1.0)
    assert texts != generate(demo, monkeypatch, gen, micro_batch_size=8), "no penalty effect"
    assert_logprobs_close(logprobs, raw_logprobs(demo, texts, [len(row) for row in logprobs]))


@pytest.mark.parametrize("drop", [True, False])
def test_sampling_with_logprobs_and_no_row_seeds_samples(demo, monkeypatch, drop) -> None:  # type: ignore[no-untyped-def]
    """Log-probs without the caller's row streams: the rows still sample (streams drawn from
    the seeded global RNG), reproducibly, with the sampled tokens' raw log-probs."""
    gen = GenerationConfig(max_new_tokens=6, temperature=3.0)
    runs = []
    for _ in range(2):
        logprobs: list[list[float]] = []
        texts = generate(
            demo, monkeypatch, gen, drop=drop, micro_batch_size=8, seed=3, logprobs=logprobs
        )
        runs.append((texts, logprobs))
    assert runs[0] == runs[1]
    texts, logprobs = runs[0]
    greedy = generate(demo, monkeypatch, GenerationConfig(max_new_tokens=6), micro_batch_size=8)
    assert texts != greedy
    assert_logprobs_close(logprobs, raw_logprobs(demo, texts, [len(row) for row in logprobs]))


def test_multinomial_sampling_draws_as_generate_does(demo, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Sampling with neither row streams nor log-probs: the decode loop draws with
    torch.multinomial from the seeded global RNG; one row per micro-batch (nothing to drop),
    its samples are generate's for the same seed."""
    gen = GenerationConfig(max_new_tokens=6, temperature=3.0)
    draws: list[int] = []
    multinomial = torch.multinomial

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        draws.append(1)
        return multinomial(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "multinomial", counted)
        loop = generate(demo, monkeypatch, gen, micro_batch_size=1, seed=4)
    assert draws  # the loop's multinomial branch ran
    assert loop == generate(demo, monkeypatch, gen, drop=False, micro_batch_size=1, seed=4)
    assert loop == generate(demo, monkeypatch, gen, micro_batch_size=1, seed=4)
    assert loop != generate(demo, monkeypatch, gen, micro_batch_size=1, seed=5)
    assert loop != generate(
        demo, monkeypatch, GenerationConfig(max_new_tokens=6), micro_batch_size=1
    )


def test_the_lm_head_gets_contiguous_hidden_states_and_the_same_logits(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """With logits_to_keep the model slices a strided view for the LM head; load_model makes it
    contiguous (torch's batched fallback for a strided input against a frozen weight is slow),
    and the kept logits are those of the whole forward."""
    from essa.backends.models import load_model
    from essa.config import ModelConfig

    model, _ = load_model(ModelConfig(name_or_path=str(tiny_model_dir)))
    for p in model.parameters():
        p.requires_grad_(False)  # frozen, as after SFT
    seen: list[bool] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous())
    )
    ids = torch.randint(3, 32, (4, 9))  # (B, T)
    with torch.no_grad():
        kept = model(input_ids=ids, logits_to_keep=3).logits  # (B, 3, V)
        whole = model(input_ids=ids).logits  # (B, T, V)
    hook.remove()
    assert seen == [True, True]
    torch.testing.assert_close(kept, whole[:, -3:], rtol=1e-5, atol=1e-5)
