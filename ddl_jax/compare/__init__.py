"""The `ddl-jax compare` application: every strategy on one workload, same data and seed."""
