"""The gradient toolkit below the GRPO, DPO and ScaleBiO recipes: the policy and its rollouts,
GRPO's losses, group sampling (with DAPO re-sampling, CURE, replay, hints and PRM credit
plugged in) and the step's hooks for its optional features (hooks.py, features.py), DPO's
pairs, ScaleBiO's mixture, SFT, LISA, and one optimizer, LR schedule, gradient clip,
checkpoint and held-out score for all of them. Functions take their config section
(``GRPOConfig``, ``GenerationConfig``, ...), never the whole ``Config``."""
