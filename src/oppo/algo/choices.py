"""The names the maths accepts, as data (imports nothing: the config and the specs read them
without torch)."""

KL_KINDS = ("k1", "k2", "k3", "abs")
"""Per-token KL estimators (``losses.kl_estimate``)."""
KL_PLACEMENTS = ("reward", "loss")
"""Where the KL goes: the per-token rewards or the actor loss (``core.KLPenalty``)."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
"""How a per-token loss becomes a scalar (``losses.aggregate``)."""
