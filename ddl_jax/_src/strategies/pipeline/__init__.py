"""Pipeline parallelism: schedules, stages, and the programs that run them."""
