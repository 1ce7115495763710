"""comm_stats' HLO reader on GPU/TPU-style async collectives, loops and element types.

The HLO snippets follow what XLA prints for GPU and TPU programs (async start/done pairs,
operand shapes inlined in compiled text), which the CPU backend never emits.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ddl_jax as ddl
from ddl_jax._src.measure.comm import collectives, shape_bytes

ADD = """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%x, %y)
}
"""


def ring_sent(kind, g, k):
    """Bytes one device sends for a K-byte collective over g devices (the module's table)."""
    return {
        "all-reduce": 2 * (g - 1) / g * k,
        "all-gather": (g - 1) / g * k,
        "reduce-scatter": (g - 1) * k,
        "all-to-all": (g - 1) / g * k,
    }[kind]


def nbytes(dtype, shape):
    return np.dtype(dtype).itemsize * math.prod(shape)


def test_async_all_reduce_reads_the_groups_of_its_start():
    hlo = f"""HloModule jit_step, is_scheduled=true, num_partitions=8
{ADD}
ENTRY %main.4 (p0: f32[1024], p1: bf16[16]) -> (f32[1024], bf16[16]) {{
  %p0 = f32[1024]{{0}} parameter(0)
  %p1 = bf16[16]{{0}} parameter(1)
  %all-reduce-start = (f32[1024]{{0}}, bf16[16]{{0}}) all-reduce-start(%p0, %p1), channel_id=1, replica_groups=[4,2]<=[8], use_global_device_ids=true, to_apply=%add, backend_config={{"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{{"is_sync":false,"no_parallel_custom_call":false}}}}
  ROOT %all-reduce-done = (f32[1024]{{0}}, bf16[16]{{0}}) all-reduce-done(%all-reduce-start)
}}
"""  # noqa: E501
    (op,) = collectives(hlo)
    g = 8 // 4  # [4,2]<=[8]: four groups of two devices
    k = nbytes(np.float32, (1024,)) + nbytes(jnp.bfloat16, (16,))
    assert (op.kind, op.nbytes, op.group, op.count) == ("all-reduce", k, g, 1)
    assert op.sent == (ring_sent("all-reduce", g, k),) * 8
    assert op.rounds == 2 * (g - 1)


def test_async_collective_permute_reads_the_pairs_of_its_start():
    pairs = [(0, 1), (1, 2), (2, 3)]  # device 3 sends nothing
    stp = ",".join(f"{{{s},{t}}}" for s, t in pairs)
    hlo = f"""HloModule jit_shift, is_scheduled=true, num_partitions=4

ENTRY %main.3 (p0: f32[128,32]) -> f32[128,32] {{
  %p0 = f32[128,32]{{1,0}} parameter(0)
  %collective-permute-start = (f32[128,32]{{1,0}}, f32[128,32]{{1,0}}, u32[], u32[]) collective-permute-start(%p0), channel_id=2, source_target_pairs={{{stp}}}, backend_config={{"collective_backend_config":{{"is_sync":false}}}}
  ROOT %collective-permute-done = f32[128,32]{{1,0}} collective-permute-done(%collective-permute-start)
}}
"""  # noqa: E501
    (op,) = collectives(hlo)
    k = nbytes(np.float32, (128, 32))  # the result, not the start's (operand, result, ...)
    sources = {s for s, _ in pairs}
    assert (op.kind, op.nbytes, op.rounds) == ("collective-permute", k, 1)
    assert op.sent == tuple(k if d in sources else 0 for d in range(4))


RS_GENERIC = f"""HloModule jit_rs, is_scheduled=true, num_partitions=8
{ADD}
%async_computation (param_0: f32[1024,128]) -> f32[256,128] {{
  %param_0 = f32[1024,128]{{1,0}} parameter(0)
  ROOT %reduce-scatter.1 = f32[256,128]{{1,0}} reduce-scatter(%param_0), channel_id=3, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, use_global_device_ids=true, dimensions={{0}}, to_apply=%add
}}

ENTRY %main.5 (p: f32[1024,128]) -> f32[256,128] {{
  %p = f32[1024,128]{{1,0}} parameter(0)
  %reduce-scatter-start = ((f32[1024,128]{{1,0}}), f32[256,128]{{1,0}}, u32[]) async-start(f32[1024,128]{{1,0}} %p), calls=%async_computation
  ROOT %reduce-scatter-done = f32[256,128]{{1,0}} async-done(((f32[1024,128]{{1,0}}), f32[256,128]{{1,0}}, u32[]) %reduce-scatter-start), calls=%async_computation
}}
"""  # noqa: E501

A2A_GENERIC = """HloModule jit_a2a, is_scheduled=true, num_partitions=8

%all_to_all (p0: f32[256,128]) -> f32[256,128] {
  %p0 = f32[256,128]{1,0} parameter(0)
  ROOT %all-to-all.2 = f32[256,128]{1,0} all-to-all(%p0), channel_id=4, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
}

ENTRY %main.6 (data: f32[256,128]) -> f32[256,128] {
  %data = f32[256,128]{1,0} parameter(0)
  %a2a-start = ((f32[256,128]{1,0}), f32[256,128]{1,0}, s32[]) async-start(%data), calls=%all_to_all
  %a2a-update = ((f32[256,128]{1,0}), f32[256,128]{1,0}, s32[]) async-update(%a2a-start)
  ROOT %a2a-done = f32[256,128]{1,0} async-done(%a2a-update)
}
"""  # noqa: E501

A2A_SUGAR = """HloModule jit_fft, is_scheduled=true, num_partitions=8

ENTRY %main.7 (param.1: f32[256,128]) -> f32[256,128] {
  %param.1 = f32[256,128]{1,0} parameter(0)
  %all-to-all-start = ((f32[256,128]{1,0}), f32[256,128]{1,0}) all-to-all-start(f32[256,128]{1,0} %param.1), channel_id=5, replica_groups=[2,4]<=[8], dimensions={0}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"collective_backend_config":{"is_sync":true,"no_parallel_custom_call":false},"force_earliest_schedule":false}
  ROOT %all-to-all-done = f32[256,128]{1,0} all-to-all-done(((f32[256,128]{1,0}), f32[256,128]{1,0}) %all-to-all-start), metadata={op_name="jit(fft)/all_to_all[axis_name=('z',) split_axis=0 concat_axis=0 tiled=True]"}
}
"""  # noqa: E501

RS_SUGAR = f"""HloModule jit_rs_sugar, is_scheduled=true, num_partitions=8
{ADD}
ENTRY %Entry (pentry: f32[1024,128]) -> f32[256,128] {{
  %pentry = f32[1024,128]{{1,0}} parameter(0)
  %reduce-scatter-start = ((f32[1024,128]{{1,0}}), f32[256,128]{{1,0}}) reduce-scatter-start(%pentry), channel_id=6, replica_groups=[2,4]<=[8], use_global_device_ids=true, dimensions={{0}}, to_apply=%add
  %reduce-scatter-update = ((f32[1024,128]{{1,0}}), f32[256,128]{{1,0}}) reduce-scatter-update(%reduce-scatter-start)
  ROOT %reduce-scatter-done = f32[256,128]{{1,0}} reduce-scatter-done(%reduce-scatter-update)
}}
"""  # noqa: E501


@pytest.mark.parametrize(
    "hlo, kind",
    [
        (RS_GENERIC, "reduce-scatter"),
        (A2A_GENERIC, "all-to-all"),
        (A2A_SUGAR, "all-to-all"),
        (RS_SUGAR, "reduce-scatter"),
    ],
    ids=["async-reduce-scatter", "async-all-to-all", "all-to-all-start", "reduce-scatter-start"],
)
def test_async_wrapped_collective_counts_once(hlo, kind):
    (op,) = collectives(hlo)  # async-done's calls= names the same computation as its start
    g = 4  # groups {0,1,2,3},{4,5,6,7}, or [2,4]<=[8]: two groups of four
    k = nbytes(np.float32, (256, 128))
    assert (op.kind, op.nbytes, op.group, op.count) == (kind, k, g, 1)
    assert op.sent == (ring_sent(kind, g, k),) * 8


def loop_hlo(body_collective, cond_collective, backend_config):
    """A psum before a while loop, optionally with another psum in its body or condition."""

    def psum(out, arg, channel):
        return (
            f"{out} = f32[8]{{0}} all-reduce({arg}), channel_id={channel}, "
            "replica_groups={{0,1,2,3}}, to_apply=%add"
        )

    body = psum("%sum.2", "%x.1", 2) if body_collective else "%sum.2 = f32[8]{0} add(%x.1, %x.1)"
    cond = psum("%sum.3", "%x.2", 3) if cond_collective else "%sum.3 = f32[8]{0} copy(%x.2)"
    return f"""HloModule jit_loop, is_scheduled=true, num_partitions=4
{ADD}
%body (param.1: f32[8]) -> f32[8] {{
  %x.1 = f32[8]{{0}} parameter(0)
  ROOT {body}
}}

%cond (param.2: f32[8]) -> pred[] {{
  %x.2 = f32[8]{{0}} parameter(0)
  {cond}
  %slice.3 = f32[1]{{0}} slice(%sum.3), slice={{[0:1]}}
  %constant.1 = f32[1]{{0}} constant({{3}})
  %lt.7 = pred[1]{{0}} compare(%slice.3, %constant.1), direction=LT
  ROOT %bitcast.1 = pred[] bitcast(%lt.7)
}}

ENTRY %main.9 (p0: f32[8]) -> f32[8] {{
  %p0 = f32[8]{{0}} parameter(0)
  %sum.1 = f32[8]{{0}} all-reduce(%p0), channel_id=1, replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  ROOT %while.1 = f32[8]{{0}} while(%sum.1), condition=%cond, body=%body{backend_config}
}}
"""


KNOWN_TRIP = ', backend_config={"known_trip_count":{"n":"%d"}}'


def test_a_loop_without_collectives_needs_no_trip_count():
    (op,) = collectives(loop_hlo(False, False, ""))
    assert (op.kind, op.count) == ("all-reduce", 1)


@pytest.mark.parametrize("body, cond", [(True, False), (False, True)])
def test_a_loop_with_collectives_needs_a_trip_count(body, cond):
    with pytest.raises(ValueError, match="while loop with collectives has no known trip"):
        collectives(loop_hlo(body, cond, ""))


@pytest.mark.parametrize("body, cond", [(True, False), (False, True), (True, True)])
def test_loop_collectives_run_per_iteration_and_per_condition_test(body, cond):
    n = 5
    ops = collectives(loop_hlo(body, cond, KNOWN_TRIP % n))
    # the condition is tested before each of the n iterations and once more to stop
    assert sorted(op.count for op in ops) == sorted([1] + [n] * body + [n + 1] * cond)
    k = nbytes(np.float32, (8,))
    assert {op.sent for op in ops} == {(ring_sent("all-reduce", 4, k),) * 4}


def test_comm_stats_skips_a_data_dependent_loop_without_collectives():
    mesh = ddl.make_mesh(data=4)

    def body(x):
        x = jax.lax.while_loop(lambda a: a[0] < 3, lambda a: a * 2, x)  # no trip count
        return jax.lax.fori_loop(0, 3, lambda _, a: a + jax.lax.psum(a, "data"), x)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x = jax.ShapeDtypeStruct((4 * 2,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    k = nbytes(np.float32, (2,))
    assert ddl.comm_stats(fn, x).bytes_by_kind == {"all-reduce": 3 * ring_sent("all-reduce", 4, k)}


def test_f8_all_gather_counts_its_bytes():
    hlo = """HloModule jit_gather, is_scheduled=true, num_partitions=8

ENTRY %main.2 (p: f8e4m3fn[128,64]) -> f8e4m3fn[1024,64] {
  %p = f8e4m3fn[128,64]{1,0} parameter(0)
  %all-gather-start = (f8e4m3fn[128,64]{1,0}, f8e4m3fn[1024,64]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  ROOT %all-gather-done = f8e4m3fn[1024,64]{1,0} all-gather-done(%all-gather-start)
}
"""  # noqa: E501
    (op,) = collectives(hlo)
    k = nbytes(ml_dtypes.float8_e4m3fn, (1024, 64))
    assert (op.kind, op.nbytes, op.group) == ("all-gather", k, 8)
    assert op.sent == (ring_sent("all-gather", 8, k),) * 8


NARROW = (
    "float8_e4m3fn float8_e5m2 float8_e4m3b11fnuz float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e4m3 float8_e3m4 float8_e8m0fnu float4_e2m1fn int4 uint4 int2 uint2"
)


@pytest.mark.parametrize("dtype", [getattr(ml_dtypes, name) for name in NARROW.split()])
def test_narrow_types_count_their_packed_bits(dtype):
    name = np.dtype(dtype).name  # e.g. float8_e4m3fn -> f8e4m3fn, int4 -> s4, uint2 -> u2
    if name.startswith("float"):
        hlo_name, bits = "f" + name[len("float") :].replace("_", ""), ml_dtypes.finfo(dtype).bits
    else:
        hlo_name, bits = name.replace("uint", "u").replace("int", "s"), ml_dtypes.iinfo(dtype).bits
    assert shape_bytes(f"{hlo_name}[3,5]{{1,0}}") == math.ceil(3 * 5 * bits / 8)


def test_an_unknown_element_type_is_an_error():
    hlo = f"""HloModule jit_odd, num_partitions=2
{ADD}
ENTRY %main.2 (p: f7e3m3[16]) -> f7e3m3[16] {{
  %p = f7e3m3[16]{{0}} parameter(0)
  ROOT %all-reduce.1 = f7e3m3[16]{{0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1}}}}, to_apply=%add
}}
"""  # noqa: E501
    with pytest.raises(ValueError, match="unknown HLO element type 'f7e3m3'"):
        collectives(hlo)


def test_a_nested_branch_runs_with_the_branches_around_it():
    """A psum in a conditional branch holding another conditional with a permute: taking
    the inner branch runs both, so its bytes and its price count the psum too."""
    mesh = ddl.make_mesh(data=8)
    x = jax.device_put(jnp.ones((8 * 1024,)), NamedSharding(mesh, P("data")))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def step(a):
        def outer(a):
            a = jax.lax.psum(a, "data")
            inner = lambda a: jax.lax.ppermute(a, "data", ring)  # noqa: E731
            return jax.lax.cond(a[1] > 3, inner, lambda a: a * 3, a)

        return jax.lax.cond(a[0] > 0, outer, lambda a: a * 2, a)

    program = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False)  # fmt: skip
    stats = ddl.comm_stats(jax.jit(program), x)
    psum, permute = 2 * 7 / 8 * 4096, 4096.0  # bytes a device sends: ring all-reduce, shift
    (outer,) = [k for k in stats.branches if "/" not in k]
    (inner,) = [k for k in stats.branches if "/" in k]
    assert inner.startswith(outer + "/")
    assert stats.branches == {outer: psum, inner: psum + permute}
    assert stats.bytes_per_device == 0.0  # nothing runs unconditionally
    network = ddl.sim.Network(bandwidth=1e6, latency=0.0)
    assert ddl.sim.estimate_step_time(stats, network, branch=outer) == pytest.approx(psum / 1e6)
    assert ddl.sim.estimate_step_time(stats, network, branch=inner) == pytest.approx(
        (psum + permute) / 1e6
    )
