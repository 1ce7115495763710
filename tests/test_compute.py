"""``ddl.sim.compute_stats``: the flops and bytes of a compiled program, read from its HLO,
against counts written by hand; and their price on a device model."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import ddl_jax as ddl
from ddl_jax._src.measure.compute import hlo_compute

X = jnp.ones((128, 128))


def stats(fn, *args):
    return ddl.sim.compute_stats(jax.jit(fn), *args)


def test_a_matrix_product_is_2mnk_flops():
    assert (
        stats(lambda x, w: x @ w, jnp.ones((64, 32)), jnp.ones((32, 16))).flops == 2 * 64 * 16 * 32
    )


def test_a_loop_counts_its_trip_count_times():
    one = stats(lambda x: x @ x, X).flops
    ten = stats(lambda x: lax.scan(lambda c, _: (c @ x, None), x, None, length=10)[0], X).flops
    assert ten == 10 * one == 10 * 2 * 128**3


def test_a_conditional_counts_its_costliest_branch():
    two = stats(lambda p, x: lax.cond(p, lambda x: x @ x @ x, lambda x: x, x), True, X)
    assert two.flops == 2 * 2 * 128**3


def test_a_convolution_counts_each_output_times_its_window():
    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    out = stats(conv, jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16)))
    assert out.flops == 2 * (2 * 8 * 8 * 16) * (3 * 3 * 3)


def test_bytes_count_what_kernels_write():
    # One product writing a 128 x 128 float32 result.
    assert stats(lambda x: x @ x, X).bytes == 128 * 128 * 4


def test_the_price_on_a_device_and_bad_devices():
    work = ddl.sim.ComputeStats(flops=2e9, bytes=1e9)
    assert ddl.sim.estimate_compute_time(work, ddl.sim.Device(1e12, 1e11)) == pytest.approx(0.012)
    with pytest.raises(ValueError, match="device.flops_per_s"):
        ddl.sim.estimate_compute_time(work, ddl.sim.Device(0.0, 1e11))


def test_a_strategy_step_is_priced_the_same_every_time(mlp):
    loss_fn, params = mlp
    strategy = ddl.data_parallel(loss_fn, optax.sgd(0.1), ddl.make_mesh(data=4))
    state = strategy.init(params)
    batch = {"x": jnp.zeros((32, 12)), "y": jnp.zeros(32, jnp.int32)}
    first = ddl.sim.compute_stats(jax.jit(strategy.step), state, batch)
    assert first == ddl.sim.compute_stats(jax.jit(strategy.step), state, batch)
    # Each worker's 8 examples: the forward and the backward of 12 -> 16 -> 5 (the first
    # layer's input gradient is not needed): 2 * 8 * (12*16 + 16*5) * 3 - 2 * 8 * 12*16.
    assert first.flops == 2 * 8 * (12 * 16 + 16 * 5) * 3 - 2 * 8 * 12 * 16


def test_the_measuring_functions_name_a_wrong_argument():
    stats = ddl.sim.compute_stats(jax.jit(lambda x: x * 2), jnp.ones(4))
    with pytest.raises(TypeError, match="compute_stats: jitted must be a jax.jit function"):
        ddl.sim.compute_stats(lambda x: x * 2, jnp.ones(4))
    with pytest.raises(ValueError, match="stats.flops must be a finite real number >= 0"):
        ddl.sim.estimate_compute_time(stats._replace(flops=-1.0), ddl.sim.CPU_CORE)
    with pytest.raises(TypeError, match="estimate_step_time: stats must be a ddl.sim.CommStats"):
        ddl.sim.estimate_step_time(stats, ddl.sim.ETHERNET_1G)
    with pytest.raises(TypeError, match="device must be a ddl.sim.Device"):
        ddl.sim.estimate_compute_time(stats, "a100")
    with pytest.raises(ValueError, match="mixing_matrix: n must be an int >= 1, got 0"):
        ddl.mixing_matrix("ring", 0)


def test_a_loop_of_unknown_trip_count_counts_once_and_is_counted_apart():
    def loop(x, w, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ w, c[1] + 1), (x, 0))[0]

    x = jnp.ones((32, 32))
    stats = ddl.sim.compute_stats(jax.jit(loop), x, x, 5)
    assert stats.flops == 2 * 32**3 and stats.dynamic_loops == 1  # one trip of the five
    fixed = ddl.sim.compute_stats(jax.jit(lambda x, w: loop(x, w, 5)), x, x)
    assert fixed.flops == 5 * 2 * 32**3 and fixed.dynamic_loops == 0


# A dot as XLA:GPU's cuBLAS rewrite prints it: a custom-call, whose flops are not read.
CUBLAS_HLO = r"""HloModule jit_f

ENTRY %main.4 (Arg_0.1: f32[64,32], Arg_1.2: f32[32,16]) -> f32[64,16] {
  %Arg_0.1 = f32[64,32]{1,0} parameter(0)
  %Arg_1.2 = f32[32,16]{1,0} parameter(1)
  %custom-call.1 = (f32[64,16]{1,0}, s8[4194304]{0}) custom-call(f32[64,32]{1,0} %Arg_0.1, f32[32,16]{1,0} %Arg_1.2), custom_call_target="__cublas$gemm", backend_config={}
  ROOT %get-tuple-element = f32[64,16]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""  # noqa: E501


def test_library_calls_are_counted_apart():
    stats = hlo_compute(CUBLAS_HLO)
    assert stats.library_calls == 1 and stats.flops == 0.0
