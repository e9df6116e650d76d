"""Weights: precision (fp32 masters, low-precision serving copies) in :mod:`.precision`, and the
transport of updated weights to the roles that serve them (bucketed packs, collectives) in
:mod:`.sync`."""
