"""``ddl-jax compare``'s strategy specs, networks and workloads' names.

Every strategy a comparison can run is one row of ``FAMILIES``: its name, how the text
after ``name:`` is parsed (with the one-line message a bad value gets), and how the
strategy is built. ``parse_spec`` (here) and ``make_config`` (``config``) are the
only places a command line or a TOML file is checked, so both say the same thing about the
same mistake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optax
from jax.sharding import Mesh

import ddl_jax as ddl
from ddl_jax import Strategy, async_local, compression, sim, softsync, ssp

#: The gossip topologies and ZeRO stages a spec may name (``ddl.gossip``, ``ddl.fsdp``).
TOPOLOGIES = ("ring", "torus", "exponential", "complete", "one_peer_exponential")
STAGES = (1, 2, 3)

#: Learning rate of the Adam (AdamW for DiLoCo's inner steps) every strategy uses.
LEARNING_RATE = 3e-3

#: Networks a comparison can price communication on (alpha-beta model, ``ddl.sim``).
NETWORKS: dict[str, sim.Network] = {
    "1gbps": sim.ETHERNET_1G,
    "10gbps": sim.Network(bandwidth=10e9 / 8, latency=20e-6),
    "100gbps": sim.INFINIBAND_100G,
    "ici": sim.TPU_V4_ICI,
}

#: Device models the computation is priced on (``ddl.sim.Device``), by ``--compute`` name.
DEVICES: dict[str, sim.Device] = {
    "cpu": sim.CPU_CORE,
    "a100": sim.A100,
    "h100": sim.H100,
    "tpu-v4": sim.TPU_V4,
}

#: Workloads by name (built in ``workloads``).
WORKLOADS = ("digits-mlp", "digits-cnn", "digits-resnet", "text-gpt")

#: The strategies ``ddl-jax compare`` runs by default: one of every family.
DEFAULT_STRATEGIES = (
    "sync",
    "ring",
    "fsdp:3",
    "local:16",
    "diloco:16",
    "streaming:4",
    "desloc:16",
    "sparseloco:0.01",
    "noloco:16",
    "topk:0.01",
    "demo:0.0625",
    "qsgd:4",
    "sign",
    "powersgd:4",
    "adasum",
    "async",
    "asynclocal:4",
    "softsync:2",
    "ssp:2",
    "gossip:ring",
)


#: Named strategy lists for ``--preset`` (``default`` is ``DEFAULT_STRATEGIES``).
PRESETS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_STRATEGIES,
    # The communication-efficient methods against synchronous training and DiLoCo.
    "low-bandwidth": (
        "sync",
        "diloco:16",
        "streaming:4",
        "desloc:16",
        "sparseloco:0.01",
        "noloco:16",
        "demo:0.0625",
        "topk:0.01",
        "qsgd:4",
        "powersgd:4",
        "asynclocal:4",
    ),
    # The families with a model of lost messages and absent workers, for --drop and --churn.
    "unreliable": (
        "sync",
        "local:16",
        "diloco:16",
        "desloc:16",
        "sparseloco:0.01",
        "gossip:ring",
        "async",
        "asynclocal:4",
        "softsync:8",
    ),
    # Islands: the outer methods over FSDP inside --islands islands, against flat training.
    "islands": (
        "sync",
        "fsdp:3",
        "diloco:16",
        "diloco:16/sync",
        "diloco:16/fsdp:3",
        "streaming:4/fsdp:3",
        "sparseloco:0.01/fsdp:3",
        "noloco:16/fsdp:3",
    ),
}


class CompareError(ValueError):
    """A bad comparison input; its message is one line, printed as is by the CLI."""


class BuildContext(NamedTuple):
    """What a family's builder needs besides its parameter.

    Attributes:
      loss_fn: ``(params, batch) -> loss`` or a ``ddl.ModelLoss``.
      mesh: the mesh (axis ``data``).
      straggler: compute time of the slowest worker relative to the others (>= 1).
      seed: the comparison's seed.
      consensus_every: steps between gossip's consensus-distance measurements.
      drop: the probability that a message is lost (families with ``unreliable``).
      churn: the probability that a worker is absent from a step (a task, for the async
        family; families with ``unreliable``).
      workers: the workers, several a device (``None``: one a device).
      rows: the rows of the global batch each worker gets (``None``: not known).
    """

    loss_fn: Any
    mesh: Mesh
    straggler: float
    seed: int
    consensus_every: int
    drop: float = 0.0
    workers: int | None = None
    rows: int | None = None
    churn: float = 0.0

    def faults(self) -> dict[str, float]:
        """``drop`` and ``churn`` as ``local_sgd`` and ``gossip`` take them."""
        return {"drop": self.drop, "churn": self.churn}

    def lost_gradient(self) -> float:
        """For data parallelism: the probability that a worker's gradient is missing from
        a step's all-reduce, lost (``drop``) or its worker absent (``churn``), which are
        one event there."""
        return 1.0 - (1.0 - self.drop) * (1.0 - self.churn)


class Family(NamedTuple):
    """One strategy family: ``name[:param]``.

    Attributes:
      build: ``(param, context) -> Strategy``.
      parse: text after ``:`` to the parameter; raises ``ValueError`` when invalid.
      default: the text used when no ``:param`` is given (``None``: the parameter is
        ``None``; optional then, unless ``parse`` is ``_none``: the family takes none).
      expects: what the parameter is, for error messages (``""`` without one).
      describe: one line saying what the strategy does.
      asynchronous: simulated by ``ddl.async_sgd`` (gets the straggler's compute time).
      unreliable: has a model of lost messages and absent workers (takes ``--drop`` and
        ``--churn``).
      exchange_one_a_device: with several workers a device (``--workers``), the
        collectives of its events (those in branches) are priced from its program with
        one worker a device, not by ``ddl.sim.per_worker``: there a worker sends its peer
        what it sends whatever the worker count, where the program with several a device
        gathers every worker's values (NoLoCo), which the method does not send.
    """

    build: Callable[[Any, BuildContext], Strategy]
    parse: Callable[[str], Any]
    default: str | None
    expects: str
    describe: str
    asynchronous: bool = False
    unreliable: bool = False
    exchange_one_a_device: bool = False


def _int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise ValueError
        return value

    return parse


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError
    return value


#: ``ddl.gossip``'s orders: ``gossip:TOPOLOGY:ORDER`` picks one (default D-PSGD's).
GOSSIP_ORDERS = ("dpsgd", "adapt_then_combine")


def _topology(text: str) -> tuple[str, str]:
    """``gossip``'s ``TOPOLOGY`` or ``TOPOLOGY:ORDER``."""
    topology, colon, order = text.partition(":")
    if topology not in TOPOLOGIES or (colon and order not in GOSSIP_ORDERS):
        raise ValueError
    return topology, order if colon else GOSSIP_ORDERS[0]


def _stage(text: str) -> int:
    value = int(text)
    if value not in STAGES:
        raise ValueError
    return value


def _none(text: str) -> None:
    raise ValueError


#: ``ddl.scale_by_staleness``'s rules: ``async:RULE`` scales Adam's step by one of them.
STALENESS_RULES = ("inverse", "exp")


def _staleness_rule(text: str) -> str:
    if text not in STALENESS_RULES:
        raise ValueError
    return text


def _group_and_rule(text: str) -> tuple[int, str | None]:
    """``softsync``'s ``N`` or ``N:RULE``: the group size, and a staleness rule or none."""
    size, colon, rule = text.partition(":")
    return _int(1)(size), _staleness_rule(rule) if colon else None


def _levels_and_scale(text: str) -> tuple[int, str]:
    """``qsgd``'s ``S`` or ``S:max``: the levels a sign, and the buckets' scale (the
    paper's 2-norm, or QSGDinf's largest magnitude)."""
    levels, colon, scale = text.partition(":")
    value = _int(1)(levels)
    if value > 127 or (colon and scale != "max"):
        raise ValueError
    return value, scale if colon else "l2"


def _adam() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def _async(protocol: Any, *, local: bool = False) -> Callable[[Any, BuildContext], Strategy]:
    def build(param: Any, ctx: BuildContext) -> Strategy:
        n = ctx.mesh.shape["data"] if ctx.workers is None else ctx.workers
        times: Any = 1.0
        if ctx.straggler != 1.0:  # the last worker is the straggler
            times = ddl.compute_times([1.0] * (n - 1) + [ctx.straggler], seed=ctx.seed)
        rule = None  # async:RULE, softsync:N:RULE: Zhang et al.'s staleness-aware step
        if protocol == "async":
            rule = param
        elif protocol is softsync:
            param, rule = param
        chosen = protocol(param) if callable(protocol) else protocol
        # the server's optimizers here act elementwise: a sharded server is the same run,
        # each device applying every push to its block of the parameters
        options = {"compute_time": times, "protocol": chosen, "drop": ctx.drop,
                   "workers": ctx.workers, "server": "sharded"}  # fmt: skip
        if ctx.churn:  # a worker leaves after a task with that probability, away for one task
            options["churn"] = ddl.churn(leave=ctx.churn, away=param if local else 1.0)
        if not local:
            server = _adam()
            if rule is not None:
                server = optax.chain(server, ddl.scale_by_staleness(rule))
            return ddl.async_sgd(ctx.loss_fn, server, ctx.mesh, **options)
        if ctx.rows is not None and ctx.rows % param:  # H micro-batches of a worker's rows
            fits = max(h for h in range(1, param) if ctx.rows % h == 0)
            raise ValueError(
                f"H={param} inner steps do not divide the {ctx.rows} rows a worker gets; "
                f"choose a divisor, e.g. asynclocal:{fits}."
            )
        # asynchronous local SGD: inner AdamW, the server's delayed Nesterov over N arrivals;
        # momentum 0.5, as DiLoCo's 0.9 overshoots at H = 4 here (0.906 against 0.967 test
        # accuracy on digits; the GPT diverges)
        outer = ddl.delayed_nesterov(0.7, 0.5, delay=n)
        inner = optax.adamw(LEARNING_RATE)
        return ddl.async_sgd(ctx.loss_fn, outer, ctx.mesh, inner_optimizer=inner, **options)

    return build


def _nesterov() -> optax.GradientTransformation:
    """DiLoCo's outer optimizer."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


def _diloco(period: int, ctx: BuildContext) -> Strategy:
    inner = optax.adamw(LEARNING_RATE)
    return ddl.local_sgd(
        ctx.loss_fn,
        inner,
        ctx.mesh,
        period=period,
        outer_optimizer=_nesterov(),
        **ctx.faults(),
        workers=ctx.workers,
    )


#: Streaming DiLoCo's period, DiLoCo's default here; its fragments divide it.
STREAMING_PERIOD = 16


def _streaming(fragments: int, ctx: BuildContext) -> Strategy:
    return ddl.streaming_diloco(
        ctx.loss_fn,
        optax.adamw(LEARNING_RATE),
        ctx.mesh,
        period=STREAMING_PERIOD,
        fragments=fragments,
        overlap=1,
        mix=0.5,
        outer_optimizer=_nesterov(),
        workers=ctx.workers,
    )


def _fragments(text: str) -> int:
    fragments = _int(1)(text)
    if STREAMING_PERIOD % fragments:
        raise ValueError(text)
    return fragments


def _sparse_loco(ratio: float, ctx: BuildContext) -> Strategy:
    # SparseLoCo's error feedback stands in for the outer momentum: outer SGD at lr 1.
    return ddl.local_sgd(
        ctx.loss_fn,
        optax.adamw(LEARNING_RATE),
        ctx.mesh,
        period=16,
        outer_optimizer=optax.sgd(1.0),
        reducer=lambda axis: compression.sparse_loco(ratio, axis=axis),
        **ctx.faults(),
        workers=ctx.workers,
    )


#: DeMo's sign-descent step size (its updates are +-lr per entry).
DEMO_LEARNING_RATE = 1e-3


def _reduced(make: Callable[[Any, Any], Any] | None) -> Callable[[Any, BuildContext], Strategy]:
    """Data parallelism with Adam and the reducer ``make(param, axis)`` (``None``: the
    mean), built over the workers' axis."""

    def build(param: Any, ctx: BuildContext) -> Strategy:
        reducer = None if make is None else (lambda axis: make(param, axis))
        return ddl.data_parallel(ctx.loss_fn, _adam(), ctx.mesh, reducer=reducer,
                                 workers=ctx.workers, drop=ctx.lost_gradient())  # fmt: skip

    return build


def _one_a_device(why: str, build: Callable[[Any, BuildContext], Strategy]) -> Any:
    """``build``, refusing several workers a device, ``why`` saying why."""

    def checked(param: Any, ctx: BuildContext) -> Strategy:
        if ctx.workers not in (None, ctx.mesh.shape["data"]):
            raise ValueError(f"{why}: drop workers.")
        return build(param, ctx)

    return checked


def _gossip(param: tuple[str, str], ctx: BuildContext) -> Strategy:
    """Gossip; with several workers a device only on a ring of 3 devices or more, whose
    worker shifts are device shifts (``ddl.sim.per_worker`` prices merged shifts low: the
    other topologies', and a ring's two on 2 devices, both to the other device)."""
    topology, order = param
    devices = ctx.mesh.shape["data"]
    if ctx.workers not in (None, devices) and (topology != "ring" or devices < 3):
        why = f"gossip:{topology}" if topology != "ring" else f"gossip:ring on {devices} devices"
        raise ValueError(
            f"{why} with several workers a device is priced from the device shifts its "
            "worker shifts merge into, fewer than it sends: use gossip:ring on 3 devices or "
            "more, or drop workers."
        )
    # one_peer_exponential's rounds are branches, priced as its event (mixing_rounds): no
    # consensus measurement, a branch of its own (the table's distance is the state's)
    dynamic = topology == "one_peer_exponential"
    return ddl.gossip(
        ctx.loss_fn,
        _adam(),
        ctx.mesh,
        topology=topology,
        order=order,
        consensus_every=0 if dynamic else ctx.consensus_every,
        **ctx.faults(),
        workers=ctx.workers,
    )


FAMILIES: dict[str, Family] = {
    "sync": Family(
        _reduced(None),
        _none,
        None,
        "",
        "synchronous data parallelism, XLA all-reduce",
        unreliable=True,
    ),
    "ring": Family(
        _one_a_device(
            "a worker's compute in the ring grows with its 2 (N - 1) rounds, which one "
            "worker a device on fewer devices does not price",
            _reduced(lambda _, axis: ddl.allreduce_mean(axis, algorithm="ring")),
        ),
        _none,
        None,
        "",
        "synchronous data parallelism, explicit ring all-reduce",
        unreliable=True,
    ),
    "fsdp": Family(
        _one_a_device(
            "fsdp splits its state over the devices, one worker each",
            lambda stage, ctx: ddl.fsdp(ctx.loss_fn, _adam(), ctx.mesh, stage=stage),
        ),
        _stage,
        "3",
        "the ZeRO stage, 1, 2 or 3 (e.g. fsdp:3)",
        "sharded data parallelism (ZeRO / FSDP): state split over the workers",
    ),
    "local": Family(
        lambda h, ctx: ddl.local_sgd(
            ctx.loss_fn, _adam(), ctx.mesh, period=h, workers=ctx.workers, **ctx.faults()
        ),
        _int(1),
        "16",
        "the period H, an integer >= 1 (e.g. local:16)",
        "local SGD: parameters averaged every H steps",
        unreliable=True,
    ),
    "diloco": Family(
        _diloco,
        _int(1),
        "16",
        "the period H, an integer >= 1 (e.g. diloco:16)",
        "DiLoCo: inner AdamW, outer Nesterov SGD every H steps",
        unreliable=True,
    ),
    "streaming": Family(
        _streaming,
        _fragments,
        "4",
        f"the fragments P, an integer dividing {STREAMING_PERIOD} (e.g. streaming:4)",
        f"Streaming DiLoCo: P fragments in turn (H = {STREAMING_PERIOD}), overlap 1, mix 0.5",
    ),
    "desloc": Family(
        lambda h, ctx: ddl.local_sgd(
            ctx.loss_fn,
            _adam(),
            ctx.mesh,
            period=h,
            state_periods={"mu": 3 * h, "nu": 6 * h},
            workers=ctx.workers,
            **ctx.faults(),
        ),
        _int(1),
        "16",
        "the parameters' period H, an integer >= 1 (e.g. desloc:16)",
        "DES-LOC: parameters averaged every H steps, Adam's moments every 3H and 6H",
        unreliable=True,
    ),
    "sparseloco": Family(
        _sparse_loco,
        _ratio,
        "0.01",
        "the ratio of entries sent per 64x64 tile, a number in (0, 1] (e.g. sparseloco:0.01)",
        "SparseLoCo: DiLoCo (H = 16) with top-k 2-bit outer gradients, error feedback",
        unreliable=True,
    ),
    "noloco": Family(
        lambda h, ctx: ddl.noloco(
            ctx.loss_fn,
            optax.adamw(LEARNING_RATE),
            ctx.mesh,
            period=h,
            consensus_every=0,
            workers=ctx.workers,
        ),
        _int(1),
        "16",
        "the period H, an integer >= 1 (e.g. noloco:16)",
        "NoLoCo: every H steps an outer step (lr 0.7, momentum 0.5) with one random peer",
        exchange_one_a_device=True,
    ),
    "demo": Family(
        lambda ratio, ctx: ddl.data_parallel(
            ctx.loss_fn,
            optax.chain(optax.scale_by_sign(), optax.scale(-DEMO_LEARNING_RATE)),
            ctx.mesh,
            reducer=lambda axis: compression.demo(ratio, axis=axis),
            workers=ctx.workers,
        ),
        _ratio,
        "0.0625",
        "the ratio of DCT coefficients sent per 64x64 tile, in (0, 1] (e.g. demo:0.0625)",
        "DeMo: top DCT coefficients of each worker's momentum, sign descent",
    ),
    "topk": Family(
        _reduced(lambda ratio, axis: compression.top_k(ratio, axis=axis)),
        _ratio,
        "0.01",
        "the ratio of entries sent, a number in (0, 1] (e.g. topk:0.01)",
        "top-k sparsified gradients with error feedback (DGC's sampled threshold)",
    ),
    "qsgd": Family(
        _reduced(lambda p, axis: compression.qsgd(p[0], scale=p[1], axis=axis)),
        _levels_and_scale,
        "4",
        "the levels a sign, an integer in [1, 127], then :max for QSGDinf's scale (e.g. "
        "qsgd:4, qsgd:4:max)",
        "QSGD: unbiased stochastic levels in 2 to 8 bits, a bucket scaled by its 2-norm "
        "(:max, by its largest magnitude)",
        unreliable=True,
    ),
    "sign": Family(
        _reduced(lambda _, axis: compression.sign(axis=axis)),
        _none,
        None,
        "",
        "1-bit sign compression with error feedback, then Adam (the naive scheme)",
    ),
    "powersgd": Family(
        _reduced(lambda rank, axis: compression.power_sgd(rank, start_iter=0, axis=axis)),
        _int(1),
        "4",
        "the rank, an integer >= 1 (e.g. powersgd:4)",
        "PowerSGD low-rank gradients with error feedback, compressing from the first step",
    ),
    "adasum": Family(
        _reduced(lambda _, axis: ddl.adasum(axis)),
        _none,
        None,
        "",
        "Adasum: gradients combined by adaptive summation (Horovod)",
    ),
    "async": Family(
        _async("async"),
        _staleness_rule,
        None,
        "a staleness rule for the server's step, inverse (lr / tau) or exp "
        "(lr exp(-0.1 tau)), or none (e.g. async:inverse)",
        "asynchronous SGD against a parameter server (async:RULE: Adam's step scaled by "
        "the push's staleness tau, Zhang et al.)",
        asynchronous=True,
        unreliable=True,
    ),
    "asynclocal": Family(
        _async(async_local, local=True),
        _int(1),
        "4",
        "inner steps H per push, an integer dividing the rows a worker gets (e.g. asynclocal:4)",
        "asynchronous local SGD: H inner AdamW steps per push, delayed Nesterov (0.7, 0.5) server",
        asynchronous=True,
        unreliable=True,
    ),
    "softsync": Family(
        _async(softsync),
        _group_and_rule,
        "2",
        "gradients per server update, an integer >= 1, then optionally a staleness rule "
        "for the server's step, inverse or exp (e.g. softsync:2, softsync:8:inverse)",
        "n-softsync: the server averages every n arrivals (softsync:N:RULE: Adam's step "
        "scaled by the group's mean staleness tau, Zhang et al.'s rule for an Adam server; "
        "for SGD, ddl.softsync(n, scale=RULE) scales each gradient by its own)",
        asynchronous=True,
        unreliable=True,
    ),
    "ssp": Family(
        _async(ssp),
        _int(0),
        "2",
        "the staleness bound, an integer >= 0 (e.g. ssp:2)",
        "stale-synchronous parallel: at most s clocks ahead, each worker reading its cached "
        "copy while it is within the bound (Ho et al.)",
        asynchronous=True,
        unreliable=True,
    ),
    "gossip": Family(
        _gossip,
        _topology,
        "ring",
        f"a topology, one of {', '.join(TOPOLOGIES)}, then :ORDER, one of "
        f"{', '.join(GOSSIP_ORDERS)} (e.g. gossip:ring, gossip:one_peer_exponential:"
        "adapt_then_combine)",
        "gossip averaging with neighbours (D-PSGD's order, or adapt-then-combine)",
        unreliable=True,
    ),
}


def _on_islands(
    make: Callable[[Any, BuildContext], dict[str, Any]],
) -> Callable[[Any, Strategy, BuildContext], Strategy]:
    def build(param: Any, inner: Strategy, ctx: BuildContext) -> Strategy:
        return ddl.local_sgd(inner=inner, **make(param, ctx))

    return build


#: The outer methods a stacked spec (``outer/inner``) may name, with the same settings as
#: their flat families.
OUTER_ON_ISLANDS: dict[str, Callable[[Any, Strategy, BuildContext], Strategy]] = {
    "local": _on_islands(lambda h, ctx: {"period": h, **ctx.faults()}),
    "diloco": _on_islands(
        lambda h, ctx: {"period": h, "outer_optimizer": _nesterov(), **ctx.faults()}
    ),
    "desloc": _on_islands(
        lambda h, ctx: {
            "period": h,
            "state_periods": {"mu": 3 * h, "nu": 6 * h},
            **ctx.faults(),
        }
    ),
    "sparseloco": _on_islands(
        lambda ratio, ctx: {
            "period": 16,
            "outer_optimizer": optax.sgd(1.0),
            "reducer": compression.sparse_loco(ratio, axis="island"),
            **ctx.faults(),
        }
    ),
    "noloco": lambda h, inner, ctx: ddl.noloco(inner=inner, period=h),
    "gossip": lambda param, inner, ctx: ddl.gossip(
        inner=inner, topology=param[0], order=param[1], **ctx.faults()
    ),
    "streaming": lambda fragments, inner, ctx: ddl.streaming_diloco(
        inner=inner,
        period=STREAMING_PERIOD,
        fragments=fragments,
        overlap=1,
        mix=0.5,
        outer_optimizer=_nesterov(),
    ),
}
#: The inner strategies a stacked spec may name (each island runs one).
INNER_ON_ISLANDS = ("sync", "fsdp")


class Spec(NamedTuple):
    """A parsed strategy spec.

    Attributes:
      text: the spec as given (``"local:16"``), the strategy's label everywhere.
      family: the key of ``FAMILIES`` (a stacked spec's outer method).
      param: the parsed parameter (``None`` for a family without one).
      inner: a stacked spec's inner strategy (``"diloco:16/fsdp:3"``: each island trains
        ``fsdp:3``, DiLoCo across islands); ``None`` for a flat one.
    """

    text: str
    family: str
    param: Any
    inner: Spec | None = None

    def build(self, ctx: BuildContext) -> Strategy:
        """The strategy this spec names, on ``ctx.mesh`` (with an ``island`` axis when
        stacked)."""
        if self.inner is None:
            return FAMILIES[self.family].build(self.param, ctx)
        inner = self.inner.build(ctx)
        return OUTER_ON_ISLANDS[self.family](self.param, inner, ctx)


def parse_spec(text: str) -> Spec:
    """Parses one ``name[:param]`` strategy spec, or a stacked ``outer/inner`` one.

    Args:
      text: e.g. ``"sync"``, ``"local:16"``, ``"topk:0.01"``, ``"gossip:ring"``,
        ``"diloco:16/fsdp:3"`` (DiLoCo across islands, FSDP within each).

    Returns:
      The ``Spec``; a family's default parameter fills in a missing one.

    Raises:
      CompareError: an unknown name (the message lists the valid ones), or a parameter
        that is missing, not wanted, or not what the family expects; a stacked spec whose
        outer or inner method cannot stack.
    """
    if not isinstance(text, str):
        raise CompareError(f"a strategy spec must be a string like 'local:16', got {text!r}.")
    outer_text, slash, inner_text = text.strip().partition("/")
    if not slash:
        return _parse_flat(text)
    outer, inner = _parse_flat(outer_text), _parse_flat(inner_text)
    if outer.family not in OUTER_ON_ISLANDS or inner.family not in INNER_ON_ISLANDS:
        raise CompareError(
            f"cannot stack {text!r}: the outer method (before '/') must be one of "
            f"{', '.join(OUTER_ON_ISLANDS)}, the inner one of {', '.join(INNER_ON_ISLANDS)} "
            "(e.g. diloco:16/fsdp:3)."
        )
    return Spec(f"{outer.text}/{inner.text}", outer.family, outer.param, inner)


def _parse_flat(text: str) -> Spec:
    name, colon, raw = text.strip().partition(":")
    family = FAMILIES.get(name)
    if family is None:
        raise CompareError(
            f"unknown strategy {name!r} in {text!r}; valid names: {', '.join(FAMILIES)}."
        )
    if not colon:
        raw = family.default
        if raw is None:  # none, or an optional one (async:RULE)
            return Spec(name, name, None)
    elif family.parse is _none:
        raise CompareError(f"strategy {name!r} takes no parameter, got {text!r}.")
    try:
        param = family.parse(raw)
    except ValueError:
        raise CompareError(
            f"bad parameter in strategy {text!r}: expected {family.expects}."
        ) from None
    return Spec(f"{name}:{raw}", name, param)


def parse_specs(value: str | Sequence[str]) -> tuple[Spec, ...]:
    """Parses a comma-separated string (or a list) of specs; refuses duplicates."""
    if not isinstance(value, str) and not (
        isinstance(value, Sequence) and all(isinstance(i, str) for i in value)
    ):
        raise CompareError(
            f"strategies must be a comma-separated string of specs like 'sync,local:16' (or "
            f"in a TOML file a list of them, ['sync', 'local:16']), got {value!r}."
        )
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [i.strip() if isinstance(i, str) else i for i in items]
    if not items or any(i == "" for i in items):
        raise CompareError(
            f"strategies must be a comma-separated list of specs like 'sync,local:16', "
            f"got {value!r}."
        )
    specs = tuple(parse_spec(i) for i in items)
    seen: set[str] = set()
    for spec in specs:
        if spec.text in seen:
            raise CompareError(f"strategy {spec.text!r} is listed twice.")
        seen.add(spec.text)
    return specs
