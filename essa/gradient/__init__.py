"""The gradient toolkit below the GRPO, DPO and ScaleBiO recipes: the policy, losses, SFT,
LISA, replay and the optional credit assignments."""
