"""Data-parallel training over several processes, checkpointed, resumed after a failure.

The same script runs everywhere; only the command that starts it changes:

    python examples/multihost.py                                     # 1 process
    ddl-jax launch -n 2 --devices-per-process 4 --restarts 1 -- \\
        python examples/multihost.py --checkpoint-dir /tmp/multihost  # 2 local processes
    srun --ntasks-per-node=1 python examples/multihost.py ...        # SLURM, one per node
    gcloud compute tpus tpu-vm ssh NAME --worker=all \\
        --command="python multihost.py ..."                          # TPU VM pod

Each process reads only its rows of every global batch; with --checkpoint-dir a
restarted run resumes from the latest complete checkpoint and ends with the parameters
an uninterrupted run would have.
"""

import argparse

import ddl_jax as ddl
import ddl_jax.launch

ddl.launch.initialize()  # before any JAX computation

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


def main() -> None:
    flags = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_argument("--steps", type=int, default=200)
    flags.add_argument("--batch-size", type=int, default=128)
    flags.add_argument("--checkpoint-dir", default=None)
    flags.add_argument("--checkpoint-every", type=int, default=50)
    args = flags.parse_args()

    train, test = ddl.data.digits()
    model = ddl.models.MLP(64, [128], 10, rngs=nnx.Rngs(0))  # same init on every process

    def loss(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss_fn, params = ddl.flax.loss_from_module(model, loss)
    apply, _ = ddl.flax.split(model)
    mesh = ddl.make_mesh()  # every device of every process on the data axis
    strategy = ddl.data_parallel(loss_fn, optax.adam(3e-3), mesh)

    def accuracy(p):
        return (apply(p, test["image"]).argmax(-1) == test["label"]).mean()

    state, history = ddl.fit(
        strategy,
        params,
        lambda start: ddl.launch.process_batches(train, args.batch_size, mesh, start=start),
        steps=args.steps,
        eval_fn=accuracy,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else None,
    )
    # (a run resumed at its last step trains nothing: its history is empty)
    step, value = args.steps, None
    if history:
        step, value = history[-1]["step"], history[-1]["eval"]
    else:
        value = float(accuracy(strategy.params(state)))
    if jax.process_index() == 0:
        print(
            f"{jax.process_count()} process(es), {len(jax.devices())} devices: "
            f"step {step}, test accuracy {value:.4f}"
        )


if __name__ == "__main__":
    main()
