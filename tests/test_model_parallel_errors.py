"""Bad ``specs`` in ``ddl.tensor_parallel`` and ``ddl.fsdp`` fail with a clear ValueError."""

import re

import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl

PARAMS = {"w": jnp.ones((4, 6)), "s": jnp.ones(())}


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"]) * params["s"])


def builders():
    mesh = ddl.make_mesh(data=4, model=2)
    return {
        "tensor_parallel": lambda specs: ddl.tensor_parallel(
            loss_fn, optax.sgd(0.1), mesh, specs=specs
        ),
        "fsdp": lambda specs: ddl.fsdp(loss_fn, optax.sgd(0.1), mesh, specs=specs),
    }


@pytest.mark.parametrize("builder", ["tensor_parallel", "fsdp"])
def test_a_spec_naming_an_axis_the_mesh_lacks_names_the_valid_axes(builder):
    strategy = builders()[builder]({"w": P(None, "modle"), "s": P()})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "specs['w']=P(None, 'modle') names axis 'modle', which the mesh does "
            "not have; valid axis names: ['data', 'model']."
        ),
    ):
        strategy.init(PARAMS)


@pytest.mark.parametrize("builder", ["tensor_parallel", "fsdp"])
def test_a_spec_longer_than_its_parameters_rank_is_refused(builder):
    strategy = builders()[builder]({"w": P(), "s": P("model")})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "specs['s']=P('model',) has more entries than params['s'] has dimensions "
            "(shape (), rank 0); a spec has at most one entry per dimension (P() for a scalar)."
        ),
    ):
        strategy.init(PARAMS)
