"""Ray: joining a cluster (or starting a local one), reading an actor's results with its failure
named, and :class:`ActorGroup`, the one helper every group of Ray actors is built on."""

from __future__ import annotations

from typing import Any

from .parts import modules_by_value


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


def ship_plugins() -> None:
    """Have Ray pickle by value (cloudpickle's ``register_pickle_by_value``: code, not an import
    path) the modules that define registered plugins' parts and that no installed distribution
    provides (``parts.modules_by_value``): an algorithm's loss, a learner engine's update strategy
    or a rollout backend's build then reaches actors whose processes never imported that module, as
    Ray's docs advise for modules not installed on the cluster. Their code must be the self-contained
    kind: a helper module they import in turn must be importable there (installed, or sent with
    Ray's ``runtime_env``)."""
    import ray.cloudpickle

    for module in modules_by_value():
        ray.cloudpickle.register_pickle_by_value(module)


class ActorGroup:
    """N Ray actors of one class, one per rank: what the rollout, scoring and learner groups are
    built on. Spawns them (optionally gang-scheduled in a placement group), calls a method on every
    rank or some, gathers the answers with each failure named by role and rank, and shuts down.

    ``cls``: a plain class (wrapped with ``ray.remote`` here); ``args(rank)``: its constructor's
    arguments; ``role``: the name in messages (``"<role> (role=<label>, rank=<r>)"``, ``labels``: each
    rank's, default ``role``'s first word; ``numbers``: the rank each is named by, default its index).
    ``placement``: a placement-group strategy (PACK, SPREAD,
    STRICT_SPREAD) to gang-schedule the ranks, waited for up to ``timeout_s``; None: no group.
    ``stop_on_failure``: a failure stops the whole group (ranks that wait in a collective would
    otherwise wait for ever). Call :func:`init_ray` first.

    Registered plugins' code that the actors may not be able to import (a test file, a module on the
    controller's path only) is sent with what they receive: :func:`ship_plugins`.
    """

    def __init__(self, cls, n: int, args, *, role: str, num_cpus: float = 1, num_gpus: float = 0,
                 placement: str | None = None, timeout_s: float = 600.0, labels: list[str] | None = None,
                 numbers: list[int] | None = None, stop_on_failure: bool = False):
        import ray

        if n < 1:
            raise ValueError(f"a group of {role}s needs at least one, got {n}")
        self.role, self.stop_on_failure = role, stop_on_failure
        self.labels = labels or [role.split()[0]] * n
        self.numbers = numbers or list(range(n))
        self.pg = None
        ship_plugins()
        options: list[dict] = [dict(num_cpus=num_cpus, num_gpus=num_gpus) for _ in range(n)]
        if placement is not None:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
            self.pg = placement_group([bundle] * n, strategy=placement)
            ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
            if not ready:
                ray.util.remove_placement_group(self.pg)
                self.pg = None
                raise RuntimeError(f"the Ray cluster cannot place {n} {role}s of {bundle} ({placement}) within "
                                   f"{timeout_s:.0f} s; it has {ray.cluster_resources()}")
            for r, o in enumerate(options):
                o["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)
        remote = ray.remote(cls)
        # Any: Ray types an actor's methods as plain functions (no ``.remote``) unless decorated with ray.method
        self.actors: list[Any] = [remote.options(**options[r]).remote(*args(r)) for r in range(n)]

    def __len__(self) -> int:
        return len(self.actors)

    def who(self, rank: int) -> str:
        return f"{self.role} (role={self.labels[rank]}, rank={self.numbers[rank]})"

    def submit(self, method: str, *args, ranks: list[int] | None = None, **kwargs) -> list:
        """Start ``method(*args, **kwargs)`` on ``ranks`` (default all); returns the refs (for :meth:`gather`)."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        return [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]

    def call(self, method: str, *args, ranks: list[int] | None = None, **kwargs) -> list:
        """``method(*args, **kwargs)`` on ``ranks`` (default all), waited for: the answers in rank order."""
        ranks = list(range(len(self.actors))) if ranks is None else ranks
        return self.gather(self.submit(method, *args, ranks=ranks, **kwargs), ranks)

    def gather(self, refs: list, ranks: list[int] | None = None, grace_s: float = 5.0) -> list:
        """The answers of ``refs`` (one call per rank of ``ranks``, default 0..). On a failure or
        death, wait ``grace_s`` for the others' outcomes and raise one RuntimeError naming every rank
        that died (first: a rank whose peer died fails in its next collective as a consequence) or
        failed; with ``stop_on_failure`` the whole group is stopped first."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        which = {ref: r for ref, r in zip(refs, ranks)}
        out: dict = {}
        left = list(refs)
        dead: list[tuple[int, BaseException]] = []
        failed: list[tuple[int, BaseException]] = []

        def outcome(ref) -> None:
            bad: BaseException
            try:
                out[ref] = ray.get(ref)
                return
            except ray.exceptions.RayActorError as e:
                bad, into = e, dead
            except ray.exceptions.RayTaskError as e:
                bad, into = e, failed
            if all(r != which[ref] for r, _ in dead + failed):  # (each rank named once)
                into.append((which[ref], bad))

        while left:
            done, left = ray.wait(left, num_returns=1)
            outcome(done[0])
            if not (dead or failed):
                continue
            more, left = ray.wait(left, num_returns=len(left), timeout=grace_s) if left else ([], [])
            for ref in more:  # the others' outcomes, briefly: name every rank that failed
                outcome(ref)
            if self.stop_on_failure:
                self.kill()
            msgs = [f"{self.who(r)} died: {one_line(e)}" for r, e in sorted(dead, key=_first)]
            msgs += [f"{self.who(r)} failed: {getattr(e, 'cause', None) or e!r}" for r, e in sorted(failed, key=_first)]
            first = (dead or failed)[0][1]
            cause = getattr(first, "cause", None) or first
            stopped = f"; the {self.role.split()[0]} group was stopped" if self.stop_on_failure else ""
            raise RuntimeError("; ".join(msgs) + stopped) from cause
        return [out[r] for r in refs]

    def shutdown(self, method: str | None = "close", timeout_s: float = 10.0) -> None:
        """Ask every actor to ``method()`` (a clean stop; None: none), wait up to ``timeout_s``, then
        kill them either way and release the placement group."""
        import ray

        if method is not None and self.actors:
            refs = self.submit(method)
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None


def _first(item: tuple) -> int:
    return item[0]
