"""Running a reducer outside a strategy: N workers, each fed its own gradients for T steps."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.core import kit
from ddl_jax._src.core.reducer import checks_vma


def reducer_program(reducer, grads, every_state=False):
    """The jitted program feeding worker i its gradients ``grads[..][:, i]`` (leaves
    ``[T, N, ...]``) for T steps, and its arguments: the workers' stacked initial reducer
    states and the gradients, placed on the mesh. The program returns the final states
    ``[N, ...]`` (``every_state``: each step's, ``[T, N, ...]``) and the outputs."""
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
            return state, (out, kit.restack(state) if every_state else ())

        mine = jax.tree.map(lambda g: g[:, 0], grads)
        state, (outs, states) = jax.lax.scan(one, kit.unstack(state), mine)
        outs = jax.tree.map(lambda x: x[:, None], outs)
        return (states if every_state else kit.restack(state)), outs

    # check_vma: the outputs must be typed as agreeing across workers, as a strategy needs
    # (unless the reducer carries the mark of one whose agreement JAX cannot prove).
    specs = (P(None, "data") if every_state else P("data"), P(None, "data"))
    program = jax.shard_map(
        worker,
        mesh=mesh,
        in_specs=(P("data"), P(None, "data")),
        out_specs=specs,
        check_vma=checks_vma(reducer),
    )
    grads = jax.device_put(grads, NamedSharding(mesh, P(None, "data")))
    return jax.jit(program), state, grads


def run_steps(reducer, grads, every_state=False):
    """Runs :func:`reducer_program`; returns the outputs (leaves ``[T, N, ...]``) and the
    final states ``[N, ...]`` (``every_state``: each step's, ``[T, N, ...]``), as numpy."""
    program, state, grads = reducer_program(reducer, grads, every_state)
    state, outs = jax.tree.map(np.asarray, program(state, grads))
    return outs, state
