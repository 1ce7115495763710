"""All-reduce algorithms side by side: bytes and rounds read from the compiled HLO, and the
alpha-beta time they would take on 1 Gb/s Ethernet and 100 Gb/s InfiniBand.

For each algorithm (XLA's psum, ring, binomial tree, central parameter server) and each
N in {2, 4, 8}, the all-reduce of one float32 gradient of ``--params`` parameters
(default 25M, 100 MB) is compiled (not run) on N simulated CPU devices. Writes
benchmarks/results/allreduce.{md,json}.

    python benchmarks/allreduce.py [--params 25000000]
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import ddl_jax as ddl

NETWORKS = {"1 Gb/s Ethernet": ddl.sim.ETHERNET_1G, "100 Gb/s InfiniBand": ddl.sim.INFINIBAND_100G}
ALGORITHMS = {
    "psum": jax.lax.psum,
    "ring": ddl.collectives.ring_allreduce,
    "tree": ddl.collectives.tree_allreduce,
    "ps": ddl.collectives.ps_allreduce,
}


def measure(algorithm: str, n: int, params: int) -> dict:
    mesh = ddl.make_mesh(data=n)
    fn = jax.jit(
        jax.shard_map(
            lambda g: ALGORITHMS[algorithm](g[0], "data")[None],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    grad = jax.ShapeDtypeStruct((n, params), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    stats = ddl.comm_stats(fn, grad)
    return {
        "algorithm": algorithm,
        "devices": n,
        "bytes_per_device": stats.bytes_per_device,
        "bytes_sent": stats.bytes_sent,
        "rounds": stats.rounds,
        "seconds": {k: ddl.sim.estimate_step_time(stats, net) for k, net in NETWORKS.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    ddl.simulate_cpu_devices(8)

    cases = [(a, n) for a in ALGORITHMS for n in (2, 4, 8)]
    rows = [measure(a, n, args.params) for a, n in tqdm(cases, desc="compiling")]
    k = 4 * args.params
    lines = [
        f"All-reduce of a {args.params / 1e6:g}M-parameter float32 gradient (K = {k / 1e6:g} MB).",
        "Bytes and rounds read from the compiled HLO; times from the alpha-beta model "
        "(busiest device, no overlap).",
        "",
        "| algorithm | N | MB sent by busiest device | / K | rounds | "
        + " | ".join(f"time on {name}" for name in NETWORKS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(NETWORKS),
    ]
    for r in rows:
        times = " | ".join(f"{r['seconds'][name] * 1e3:,.1f} ms" for name in NETWORKS)
        lines.append(
            f"| {r['algorithm']} | {r['devices']} | {r['bytes_per_device'] / 1e6:,.1f} | "
            f"{r['bytes_per_device'] / k:.3f} | {r['rounds']} | {times} |"
        )
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "allreduce.md").write_text(table)
    (args.out / "allreduce.json").write_text(
        json.dumps({"params": args.params, "rows": rows}, indent=2)
    )
    print(table)


if __name__ == "__main__":
    main()
