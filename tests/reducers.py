"""Running a reducer outside a strategy: N workers, each fed its own gradients for T steps."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.core import kit


def reducer_program(reducer, grads):
    """The jitted program feeding worker i its gradients ``grads[..][:, i]`` (leaves
    ``[T, N, ...]``) for T steps, and its arguments: the workers' stacked initial reducer
    states and the gradients, placed on the mesh."""
    n = jax.tree.leaves(grads)[0].shape[1]
    mesh = ddl.make_mesh(data=n)
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[2:], jnp.float32), grads)
    state = jax.device_put(
        jax.tree.map(lambda x: np.broadcast_to(x, (n, *np.shape(x))), reducer.init(params)),
        NamedSharding(mesh, P("data")),
    )

    def worker(state, grads):
        def one(state, g):
            out, state = reducer.update(g, state)
            return state, out

        mine = jax.tree.map(lambda g: g[:, 0], grads)
        state, outs = jax.lax.scan(one, kit.unstack(state), mine)
        return kit.restack(state), jax.tree.map(lambda x: x[:, None], outs)

    # check_vma: the outputs must be typed as agreeing across workers, as a strategy needs.
    specs = (P("data"), P(None, "data"))
    program = jax.shard_map(worker, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=True)
    grads = jax.device_put(grads, NamedSharding(mesh, P(None, "data")))
    return jax.jit(program), state, grads


def run_steps(reducer, grads):
    """Runs :func:`reducer_program`; returns the outputs (leaves ``[T, N, ...]``) and the
    final states ``[N, ...]``, as numpy."""
    program, state, grads = reducer_program(reducer, grads)
    state, outs = jax.tree.map(np.asarray, program(state, grads))
    return outs, state
