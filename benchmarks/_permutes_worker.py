"""One process of ``benchmarks/gloo_permutes.py``.

    python benchmarks/_permutes_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID SIZES

Joins the processes (gloo's transport threads idled, as ``compare --measure`` does) and
times, per size in bytes a device, the median of 9 calls of: an all-reduce, an all-gather,
a reduce-scatter, a permute round the ring (between 2 processes: both ways), one from
process 0 to 1 alone, the ring all-reduce of ``ddl.collectives`` (its permutes), that ring
after an all-reduce of the same bytes, the permute round the ring entered by process 0 20
ms after the others (timed from its entry), and the same bytes sent both ways between
processes 0 and 1 over a plain TCP socket on the same link. Process 0 prints one JSON
line: ``{size: {kind: seconds}}``.
"""

import json
import socket
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl

coordinator, n, rank, sizes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ddl.launch.initialize(coordinator, n, rank, initialization_timeout=60)
ddl.launch.idle_gloo_threads()
mesh = ddl.make_mesh(data=n)
RING = [(i, (i + 1) % n) for i in range(n)]


def reduce_scatter(a):  # the first columns a multiple of n, scattered, tiled back
    part = jax.lax.psum_scatter(a[:, : a.shape[1] // n * n], "data", scatter_dimension=1,
                                tiled=True)  # fmt: skip
    return jnp.resize(part, a.shape)


KINDS = {
    "all-reduce": lambda a: jax.lax.psum(a, "data"),
    "all-gather": lambda a: jax.lax.all_gather(a, "data", axis=1, tiled=True)[:, : a.shape[1]],
    "reduce-scatter": reduce_scatter,
    "permute round the ring": lambda a: jax.lax.ppermute(a, "data", RING),
    "permute one way (0 to 1)": lambda a: jax.lax.ppermute(a, "data", [(0, 1)]),
    "ring all-reduce": lambda a: ddl.collectives.ring_allreduce(a, "data"),
    "all-reduce, then ring all-reduce": lambda a: ddl.collectives.ring_allreduce(
        jax.lax.psum(a, "data"), "data"
    ),
}
LATE = 0.02  # seconds process 0 enters the last kind's permute after the others


def compiled(collective):
    # the ring's sum agrees across devices but is typed varying
    body = lambda a: collective(a) * 0.5  # noqa: E731
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                 check_vma=False))  # fmt: skip


def sharded(size):
    local = np.ones((1, size // 4), np.float32)
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), local)


def connected_pair():
    """A TCP connection between processes 0 and 1 over the same link (``None`` elsewhere)."""
    if rank == 0:
        server = socket.create_server((socket.gethostbyname(socket.gethostname()), 0))
    mine = server.getsockname()[1] if rank == 0 else 0
    port = int(multihost_utils.broadcast_one_to_all(np.int32(mine)))
    if rank > 1:
        return None
    if rank == 0:
        peer = server.accept()[0]
        server.close()
    else:
        peer = socket.create_connection((coordinator.rsplit(":", 1)[0], port))
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peer


def exchange(peer, size):
    """Sends ``size`` bytes to the peer while receiving its ``size``, as a permute both
    ways would, but over a plain socket."""
    sender = threading.Thread(target=peer.sendall, args=(bytes(size),))
    sender.start()
    got = 0
    while got < size:
        got += len(peer.recv(min(size - got, 1 << 20)))
    sender.join()


barrier, flag = compiled(KINDS["all-reduce"]), sharded(4)
peer = connected_pair()
results = {}
for size in map(int, sizes.split(",")):
    x = sharded(size)
    results[size] = {}
    for kind, collective in [*KINDS.items(), ("permute round the ring, process 0 late", None)]:
        late = collective is None
        fn = compiled(KINDS["permute round the ring"] if late else collective)
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(9):
            if late:  # the processes leave a scalar all-reduce together; process 0 waits
                jax.block_until_ready(barrier(flag))
                time.sleep(LATE if rank == 0 else 0.0)
            tick = time.perf_counter()  # process 0's clock: from its own entry
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - tick)
        results[size][kind] = statistics.median(times)
    times = []
    for _ in range(9):
        jax.block_until_ready(barrier(flag))
        tick = time.perf_counter()
        if peer is not None:
            exchange(peer, size)
        times.append(time.perf_counter() - tick)
    results[size]["sockets both ways (0 and 1, no gloo)"] = statistics.median(times)
if rank == 0:
    print(json.dumps(results), flush=True)
