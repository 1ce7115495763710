"""One process of ``benchmarks/peers.py``: one framework, one timed run.

    python benchmarks/_peers_worker.py FRAMEWORK NUM_PROCESSES PROCESS_ID PORT CONFIG_JSON

FRAMEWORK is ``ddl`` (``ddl.data_parallel``), ``hand`` (a hand-written ``jax.shard_map``
+ ``pmean`` step), ``torch`` (PyTorch ``DistributedDataParallel``), or ``dots`` (one
process: the step's matrix products timed alone in JAX and, if installed, PyTorch). Every framework
loads the same initial weights (``CONFIG_JSON["weights"]``, an ``.npz`` written by the
parent) and trains on the same synthetic batches (process p's come from a numpy
generator seeded with ``(seed, p)``) with plain SGD. Process 0 prints one JSON line: the
seconds of the timed steps, the loss of the first step and the loss of the last.
"""

import json
import os
import sys
import time

import numpy as np

framework, num_processes, process_id, port = sys.argv[1], *map(int, sys.argv[2:5])
config = json.loads(sys.argv[5])
weights = dict(np.load(config["weights"]))
names = [f"{kind}{i}" for i in range(len(weights) // 2) for kind in ("w", "b")]
rng = np.random.default_rng((config["seed"], process_id))
batches = [
    {
        "x": rng.normal(size=(config["batch"], config["sizes"][0])).astype(np.float32),
        "y": rng.integers(0, config["sizes"][-1], size=config["batch"]).astype(np.int32),
    }
    for _ in range(config["batches"])
]
warmup, steps, lr = config["warmup"], config["steps"], config["lr"]


def report(seconds: float, first_loss: float, last_loss: float) -> None:
    if process_id == 0:
        print(
            json.dumps({"seconds": seconds, "first_loss": first_loss, "last_loss": last_loss}),
            flush=True,
        )


def run_torch() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=process_id,
        world_size=num_processes,
    )
    layers = []
    for i in range(len(weights) // 2):
        w = weights[f"w{i}"]  # (in, out); torch's Linear holds (out, in)
        linear = torch.nn.Linear(w.shape[0], w.shape[1])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w.T.copy()))
            linear.bias.copy_(torch.from_numpy(weights[f"b{i}"]))
        layers += [linear, torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = [(torch.from_numpy(b["x"]), torch.from_numpy(b["y"]).long()) for b in batches]

    def step(i: int) -> torch.Tensor:
        x, y = data[i % len(data)]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def global_mean(loss: torch.Tensor) -> float:
        loss = loss.clone()
        dist.all_reduce(loss)
        return float(loss) / num_processes

    first = global_mean(step(0))
    for i in range(1, warmup):
        step(i)
    dist.barrier()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        loss = step(i)
    # Gradients are all-reduced inside backward(), so every process has finished its
    # last all-reduce here.
    seconds = time.perf_counter() - start
    dist.barrier()
    report(seconds, first, global_mean(loss))
    dist.barrier()
    # Past the last collective: leave without gloo's teardown, which now and then aborts
    # one process ("terminate called without an active exception") after the timing is done.
    sys.stdout.flush()
    os._exit(0)


def run_jax() -> None:
    import jax

    import ddl_jax as ddl

    if num_processes > 1:
        ddl.launch.initialize(
            f"127.0.0.1:{port}",
            num_processes,
            process_id,
            heartbeat_timeout_seconds=30,
            initialization_timeout=60,
        )
        if os.environ.get("PEERS_IDLE_GLOO_THREADS") == "1":
            ddl.launch.idle_gloo_threads()
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def loss_fn(params, batch):
        x = batch["x"]
        depth = len(params) // 2
        for i in range(depth):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < depth - 1:
                x = jax.nn.relu(x)
        return optax.softmax_cross_entropy_with_integer_labels(x, batch["y"]).mean()

    params = {k: jnp.asarray(weights[k]) for k in names}
    optimizer = optax.sgd(lr)
    mesh = ddl.make_mesh(data=num_processes)
    data = [
        jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), a),
            b,
        )
        for b in batches
    ]
    if framework == "ddl":
        strategy = ddl.data_parallel(loss_fn, optimizer, mesh)
        jitted = jax.jit(strategy.step, donate_argnums=0)
        state = strategy.init(params)

        def step(state, batch):
            state, metrics = jitted(state, batch)
            return state, metrics["loss"]

    else:

        def body(params, opt_state, batch):
            local = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(local, batch)
            grads = jax.lax.pmean(grads, "data")
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "data")

        jitted = jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())
            ),
            donate_argnums=(0, 1),
        )
        replicated = NamedSharding(mesh, P())
        state = (
            jax.device_put(params, replicated),
            jax.device_put(optimizer.init(params), replicated),
        )

        def step(state, batch):
            params, opt_state, loss = jitted(*state, batch)
            return (params, opt_state), loss

    state, loss = step(state, data[0])  # the loss is the global batch's mean
    first = float(np.asarray(loss.addressable_data(0)))
    for i in range(1, warmup):
        state, loss = step(state, data[i % len(data)])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        state, loss = step(state, data[i % len(data)])
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - start
    report(seconds, first, float(np.asarray(loss.addressable_data(0))))
    if num_processes > 1:
        jax.distributed.shutdown()


def run_dots() -> None:
    """Prints, per layer, the milliseconds of its three products: in JAX as autodiff emits
    them, as ddl runs them on one core with the XLA:CPU tunings on (``xla_cpu/products.py``),
    and in PyTorch."""
    import jax
    import jax.numpy as jnp

    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None

    def ms(fn, *args, n: int = 20) -> float:
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n * 1e3

    from ddl_jax._src.xla_cpu.products import transposed_weight_gradients

    # JAX's products as autodiff emits them; PyTorch's as its autograd computes them.
    products = {
        "forward x.W": (lambda x, w, dy: x @ w, lambda x, w, dy: x @ w),
        "input gradient dy.W^T": (
            lambda x, w, dy: jax.vjp(lambda x: x @ w, x)[1](dy)[0],
            lambda x, w, dy: dy @ w.T,
        ),
        "weight gradient x^T.dy": (
            lambda x, w, dy: jax.vjp(lambda w: x @ w, w)[1](dy)[0],
            lambda x, w, dy: x.T @ dy,
        ),
    }
    rows = []
    for i in range(len(weights) // 2):
        w = weights[f"w{i}"]
        x = rng.normal(size=(config["batch"], w.shape[0])).astype(np.float32)
        dy = rng.normal(size=(config["batch"], w.shape[1])).astype(np.float32)
        for name, (fn, torch_fn) in products.items():
            row = {"layer": f"{w.shape[0]}x{w.shape[1]}", "product": name}
            args = tuple(map(jnp.asarray, (x, w, dy)))
            row["jax_ms"] = ms(jax.jit(fn), *args)
            row["ddl_ms"] = ms(jax.jit(transposed_weight_gradients(fn)), *args)
            if torch is not None:
                row["torch_ms"] = ms(torch_fn, *map(torch.from_numpy, (x, w, dy)))
            rows.append(row)
    print(json.dumps({"dots": rows}), flush=True)


if framework == "torch":
    run_torch()
elif framework == "dots":
    run_dots()
else:
    run_jax()
