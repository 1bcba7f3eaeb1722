"""What else a tuned adapter changed: off-task KL, update size, retention and pass@K.

Forward passes and generation only, offline (docs/drift.md has the formulas). One module per
concern; callers import from the module that defines what they use:

* :mod:`essa.drift.offtask`: off-task KL, mean per-token KL(base || tuned), KL(SFT || tuned)
  and KL(base || SFT), teacher-forced on the base model's own greedy continuations of fixed
  off-task prompts, which a run generates once (``ContinuationCache``);
* :mod:`essa.drift.update`: update size, ||dW||_F / ||W0||_F per adapted matrix, mean and max,
  for the SFT adapter, the tuned one and the search;
* :mod:`essa.drift.retention`: greedy accuracy on a task the run does not train on (built-in or
  reasoning-gym) for the base, the SFT adapter and the tuned one; pass@K, maj@K, mean@K and the
  answer entropy of K sampled completions per held-out item;
* :mod:`essa.drift.models`: how the three models are reached, ``PopulationModels`` (ESSA: the
  bare base model, and the SFT and tuned vectors as two candidate rows of one PopulationLoRA
  forward) or ``PeftModels`` (GRPO and ``essa eval``: a PEFT model with its adapter switched
  off for the base);
* :mod:`essa.drift.report`: the final report, the figures of every held-out pass and the
  console line, reading the config sections of ``DriftSettings``.
"""
