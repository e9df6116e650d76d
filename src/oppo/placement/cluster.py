"""Joining a Ray cluster, or starting a local one."""

from __future__ import annotations


def init_ray(address: str | None = "auto", num_cpus: int | None = None, num_gpus: int | None = None,
             **kwargs) -> dict:
    """Connect this process (the controller) to Ray; returns the cluster's resources.

    ``address="auto"``: join the cluster already running on this machine (``ray start --head``,
    or ``RAY_ADDRESS``) if there is one, else start a local one with ``num_cpus``/``num_gpus``
    (None: all of the machine's). Note that "auto" also finds a Ray that another process of this
    machine started. ``address=None``: always start a new local one (tests). Any other address
    (``ray://...``, ``host:port``) must be reachable: it is never silently replaced by a local
    cluster. Calling it again once connected does nothing.
    """
    import ray

    if not ray.is_initialized():
        local = dict(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, **kwargs)
        if address == "auto":
            try:
                ray.init(address="auto", **kwargs)
            except ConnectionError:  # no cluster to join (Ray's own message for that case)
                ray.init(address="local", **local)
        elif address is None:
            ray.init(address="local", **local)  # "local": never a cluster found on the machine
        else:
            ray.init(address=address, **kwargs)
    return ray.cluster_resources()
