"""Train an MLP on the bundled digits with data parallelism on 8 simulated CPU devices."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import ddl_jax as ddl

ddl.simulate_cpu_devices(8)  # 8 CPU devices when there is no accelerator

train, test = ddl.data.digits()
model = ddl.models.MLP(64, [128, 128], 10, rngs=nnx.Rngs(0))


def loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


loss_fn, params = ddl.flax.loss_from_module(model, loss)
apply, _ = ddl.flax.split(model)


def accuracy(params):
    return jnp.mean(jnp.argmax(apply(params, test["image"]), -1) == test["label"])


mesh = ddl.make_mesh()  # every device: the 8 CPU ones here, all GPUs / TPU cores elsewhere
strategy = ddl.data_parallel(loss_fn, optax.adam(3e-3), mesh)
state, history = ddl.fit(
    strategy, params, ddl.data.batches(train, 128), steps=400, eval_fn=accuracy, eval_every=100
)
ddl.flax.update_module(model, strategy.params(state))
print(f"{len(jax.devices())} devices, test accuracy {history[-1]['eval']:.3f}")
