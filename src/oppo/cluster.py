"""Ray: joining a cluster (or starting a local one), and reading an actor's results with its
failure named."""

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


def start_local_cluster(nodes: int = 2, cpus_per_node: float = 1, gpus_per_node: int = 0):
    """A Ray cluster of ``nodes`` nodes on this machine (``ray.cluster_utils.Cluster``), and this
    process connected to it: what the tests run on, so that placement across nodes (a learner
    group spread over two nodes, weights crossing between their object stores) is exercised on
    one machine. Returns the function that shuts it down."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "num_gpus": gpus_per_node,
                                                              "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()

    def shutdown() -> None:
        ray.shutdown()
        cluster.shutdown()

    return shutdown


def get_named(refs, who: str):
    """``ray.get(refs)``; an actor that died or raised is reported as a RuntimeError naming ``who``
    (its role and rank) and what happened."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise RuntimeError(f"{who} died: {one_line(e)}") from e
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None) or e
        raise RuntimeError(f"{who} failed: {cause!r}") from cause


def one_line(e: BaseException) -> str:
    """A Ray actor error in one line: its first line (what happened) and its last (why: "killed by
    ray.kill", out of memory, or, when the actor's ``__init__`` raised, that exception)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
