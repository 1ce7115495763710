"""A GPT-style byte-level language model, with dropout, on the standard library's own sources.

Trains ``ddl.models.GPT`` on ``ddl.data.text()`` (no download: the corpus is Python's own
``.py`` files) with data parallelism or local SGD on 8 simulated CPU devices, and prints
the validation loss in bits per byte (8.0 knows nothing; lower is better).

    python examples/text_gpt.py --strategy local_sgd --steps 300
"""

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import ddl_jax as ddl

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--strategy", choices=["data_parallel", "local_sgd"], default="data_parallel")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--period", type=int, default=8, help="local_sgd: steps between averages")
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--context", type=int, default=64)
args = parser.parse_args()

ddl.simulate_cpu_devices(8)
train, validation = ddl.data.text()
model = ddl.models.GPT(
    context=args.context,
    features=64,
    heads=4,
    layers=2,
    dropout=0.1,
    rngs=nnx.Rngs(params=0, dropout=1),
)


def loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


loss_fn, variables = ddl.flax.loss_from_module(model, loss)  # dropout keys per worker and step
model.eval()
apply, _ = ddl.flax.split(model)  # evaluation: no dropout
held_out = next(ddl.data.lm_batches(validation, 256, args.context, seed=0))["tokens"]


@jax.jit
def bits_per_byte(params):
    logits = apply(params, held_out[:, :-1])
    nats = optax.softmax_cross_entropy_with_integer_labels(logits, held_out[:, 1:]).mean()
    return ddl.models.bits_per_byte(nats)


mesh = ddl.make_mesh(data=8)
optimizer = optax.adamw(3e-3)
if args.strategy == "data_parallel":
    strategy = ddl.data_parallel(loss_fn, optimizer, mesh)
else:
    strategy = ddl.local_sgd(loss_fn, optimizer, mesh, period=args.period)
batches = ddl.data.lm_batches(train, args.batch, args.context, seed=0)
state, history = ddl.fit(
    strategy,
    variables,
    batches,
    steps=args.steps,
    eval_fn=bits_per_byte,
    eval_every=max(args.steps // 4, 1),
)
first = float(bits_per_byte(variables))
print(
    f"{args.strategy}: validation {first:.3f} -> {history[-1]['eval']:.3f} bits per byte "
    f"after {args.steps} steps ({np.prod(held_out[:, 1:].shape)} held-out bytes)"
)
