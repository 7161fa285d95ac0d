"""controller/dcn.py: collectives read from real compiled programs (every kind, every
spelling of replica groups), what their replica group ids mean, the DCN prediction by hand
and against the MoE layer's shape-only model, and the TCP measurement on live processes."""

from __future__ import annotations

import functools
import select
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from controller.dcn import (
    Collective,
    DcnMeter,
    DcnTraffic,
    HloParseError,
    Socket,
    collectives,
    cross_slice_bytes,
    parse_ss,
    predict,
    read_sockets,
    shape_bytes,
    slices_of_mesh,
)
from programs.moe.layer import MoELayerConfig
from programs.moe.sharded import ExpertParallelism, predict_dcn_traffic, sharded_moe_layer
from slicewise.common.mesh import GangShape, MeshAxis, MeshSpec
from slicewise.testing import wait_until

ROWS = ((0, 1, 2, 3), (4, 5, 6, 7))  # groups over the minor axis of a 2x4 mesh
COLUMNS = ((0, 4), (1, 5), (2, 6), (3, 7))  # groups over its major axis
TWO_SLICES = [0, 0, 0, 0, 1, 1, 1, 1]  # the major axis across slices


def mesh_2x4(order: tuple[int, ...] = tuple(range(8))) -> Mesh:
    return Mesh(np.array(jax.devices())[list(order)].reshape(2, 4), ("a", "b"))


def compiled_text(jitted, *args) -> str:
    return jitted.lower(*args).compile().as_text()


def x8() -> jax.Array:
    return jnp.arange(64, dtype=jnp.float32).reshape(8, 8)


def in_shard_map(body, in_spec, out_spec, order: tuple[int, ...] = tuple(range(8))):
    return jax.jit(
        jax.shard_map(
            body, mesh=mesh_2x4(order), in_specs=in_spec, out_specs=out_spec, check_vma=False
        )
    )


# Each program compiles once (~0.1 s); several tests read the same text.
SHARD_MAP_PROGRAMS = {
    "psum": (lambda v: jax.lax.psum(v, "b"), P("a", "b"), P("a", None)),
    "psum_dcn": (lambda v: jax.lax.psum(v, "a"), P("a", "b"), P(None, "b")),
    "all_gather": (lambda v: jax.lax.all_gather(v, "b", tiled=True), P("a", "b"), P("a", None)),
    "psum_scatter": (
        lambda v: jax.lax.psum_scatter(v, "b", tiled=True),
        P("a", None),
        P("a", "b"),
    ),
    "all_to_all": (
        lambda v: jax.lax.all_to_all(v, "a", 0, 0, tiled=True),
        P(None, "b"),
        P(None, "b"),
    ),
    "ppermute": (
        lambda v: jax.lax.ppermute(v, "b", [(i, (i + 1) % 4) for i in range(4)]),
        P("a", "b"),
        P("a", "b"),
    ),
    "loop": (
        lambda v: jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.psum(c, "b") * 0.5, v),
        P("a", "b"),
        P("a", "b"),
    ),
}


@functools.cache
def shard_map_text(name: str, order: tuple[int, ...] = tuple(range(8))) -> str:
    body, in_spec, out_spec = SHARD_MAP_PROGRAMS[name]
    return compiled_text(in_shard_map(body, in_spec, out_spec, order), x8())


@functools.cache
def auto_sharded_text(name: str) -> str:
    """Programs whose collectives the SPMD partitioner chose, not shard_map."""
    mesh = mesh_2x4()

    def put(shape, spec):
        return jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))

    if name == "data_parallel_grad":
        # Weights split over "b" (all-gathered for the matmul), batch over "a": the
        # gradients of w and b are all-reduced over "a", combined into one tuple op.
        def loss(w, b, x):
            return jnp.sum(jnp.tanh(x @ w + b))

        out = (NamedSharding(mesh, P("b", None)), NamedSharding(mesh, P()))
        grad = jax.jit(jax.grad(loss, (0, 1)), out_shardings=out)
        return compiled_text(grad, put((8, 16), P("b", None)), jnp.ones(16), put((32, 8), P("a")))
    if name == "fsdp_grad":
        # Weights and batch both split over all 8 devices (FSDP).
        def loss(w, x):
            return jnp.sum(jnp.tanh(x @ w))

        out = NamedSharding(mesh, P(("a", "b"), None))
        grad = jax.jit(jax.grad(loss), out_shardings=out)
        return compiled_text(grad, put((8, 16), P(("a", "b"))), put((32, 8), P(("a", "b"))))
    if name == "reshard_iota":  # [b, a] -> [None, a]: an all-gather over b
        reshard = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh, P(None, "a")))
        return compiled_text(reshard, put((8, 8), P("b", "a")))
    if name == "reshard_iota_transposed":  # rows over a -> rows over b, through a matmul
        reshard = jax.jit(lambda v: v @ v.T, out_shardings=NamedSharding(mesh, P("b")))
        return compiled_text(reshard, put((8, 8), P("a")))
    raise KeyError(name)


def only(text: str, kind: str) -> Collective:
    (found,) = [c for c in collectives(text) if c.kind == kind]
    return found


# -- reading compiled HLO -----------------------------------------------------------------------


def test_shard_map_collectives_are_read_with_per_device_bytes_and_groups():
    # x is [8, 8] f32; P("a", "b") gives each device a [4, 2] block: 32 bytes.
    assert collectives(shard_map_text("psum")) == [
        Collective("all-reduce", 32, 32, ROWS, name="psum.7")
    ]
    assert only(shard_map_text("psum_dcn"), "all-reduce").groups == COLUMNS
    gather = only(shard_map_text("all_gather"), "all-gather")
    assert (gather.operand_bytes, gather.result_bytes, gather.groups) == (32, 128, ROWS)
    # [4, 8] per device in, a quarter of it (summed) out.
    scatter = only(shard_map_text("psum_scatter"), "reduce-scatter")
    assert (scatter.operand_bytes, scatter.result_bytes, scatter.groups) == (128, 32, ROWS)
    # XLA:CPU splits an all-to-all into a tuple of one operand per destination: [8, 2]
    # per device, two [4, 2] pieces, summed.
    a2a = only(shard_map_text("all_to_all"), "all-to-all")
    assert (a2a.operand_bytes, a2a.result_bytes, a2a.groups) == (64, 64, COLUMNS)
    permute = only(shard_map_text("ppermute"), "collective-permute")
    ring = tuple((r[i], r[(i + 1) % 4]) for r in ROWS for i in range(4))
    assert (permute.operand_bytes, permute.groups) == (32, ring)
    assert not any(
        c.in_loop
        for name in SHARD_MAP_PROGRAMS
        if name != "loop"
        for c in collectives(shard_map_text(name))
    )


def test_xla_cpu_widens_bfloat16_collectives_to_float32():
    # [4, 2] bfloat16 per device would be 16 bytes; XLA:CPU converts and sends float32.
    body, in_spec, out_spec = SHARD_MAP_PROGRAMS["psum_dcn"]
    program = in_shard_map(body, in_spec, out_spec)
    (psum,) = collectives(compiled_text(program, x8().astype(jnp.bfloat16)))
    assert (psum.operand_bytes, psum.result_bytes) == (32, 32)


def test_a_collective_in_a_while_body_is_listed_once_and_flagged():
    (psum,) = collectives(shard_map_text("loop"))
    assert "while(" in shard_map_text("loop")
    assert (psum.kind, psum.groups, psum.in_loop) == ("all-reduce", ROWS, True)


def test_auto_sharded_programs_use_the_mesh_and_iota_spellings():
    text = auto_sharded_text("data_parallel_grad")
    assert "replica_groups=mesh[" in text  # mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}
    gather, reduce = collectives(text)
    assert (gather.kind, gather.operand_bytes, gather.result_bytes) == ("all-gather", 128, 512)
    assert gather.groups == ROWS
    # One combined all-reduce of dw [16, 2] and db [16]: (128 + 64) bytes, over "a".
    assert (reduce.kind, reduce.operand_bytes, reduce.result_bytes) == ("all-reduce", 192, 192)
    assert reduce.groups == COLUMNS

    fsdp = collectives(auto_sharded_text("fsdp_grad"))
    assert [(c.kind, c.groups) for c in fsdp] == [
        ("all-gather", (tuple(range(8)),)),
        ("all-reduce", (tuple(range(8)),)),
    ]

    text = auto_sharded_text("reshard_iota")
    assert "replica_groups=[2,4]<=[8]" in text
    assert only(text, "all-gather").groups == ROWS
    text = auto_sharded_text("reshard_iota_transposed")
    assert "replica_groups=[4,2]<=[2,4]T(1,0)" in text
    assert only(text, "all-gather").groups == COLUMNS


def test_replica_group_ids_are_positions_in_the_mesh_not_device_ids():
    # Meshes over the same devices in other orders compile to the same groups: the ids are
    # positions in mesh.devices.flat (the executable's device assignment order).
    for order in [(0, 2, 4, 6, 1, 3, 5, 7), (7, 6, 5, 4, 3, 2, 1, 0)]:
        mesh = mesh_2x4(order)
        assert [d.id for d in mesh.devices.flat] == list(order)
        psum = only(shard_map_text("psum", order), "all-reduce")
        assert psum.groups == ROWS  # psum over "b" = the mesh's rows, by position
        rows_by_device_id = tuple(tuple(d.id for d in row) for row in mesh.devices)
        assert rows_by_device_id != ROWS
        permute = only(shard_map_text("ppermute", order), "collective-permute")
        assert permute.groups == only(shard_map_text("ppermute"), "collective-permute").groups


MESH_GROUPS = [
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}", COLUMNS),
    ("mesh['a'=2,'b'=4] {'b'}", ROWS),
    ("mesh['a'=2,'b'=4] {'a','b'}", (tuple(range(8)),)),
    # sub-axes: 'a':(pre)size is the factor of size `size` after a major factor `pre`
    ("mesh['a'=8] {'a':(1)2}", COLUMNS),
    ("mesh['a'=8] {'a':(4)2}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
    # meshes over devices in another order: rows of [[0,2,4,6],[1,3,5,7]], columns of
    # [[7,6,5,4],[3,2,1,0]]
    ("mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("mesh['a'=2,'b'=4], device_ids=(7,6,5,4,3,2,1,0) {'a'}", ((7, 3), (6, 2), (5, 1), (4, 0))),
    ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("{}", (tuple(range(8)),)),
]


def one_all_reduce(groups: str) -> str:
    return (
        "HloModule m, num_partitions=8\n\n"
        "%add (x: f32[], y: f32[]) -> f32[] {\n  %x = f32[] parameter(0)\n"
        "  %y = f32[] parameter(1)\n  ROOT %s = f32[] add(%x, %y)\n}\n\n"
        "ENTRY %main (p: f32[8]) -> f32[8] {\n  %p = f32[8]{0} parameter(0)\n"
        f"  ROOT %r = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, "
        "use_global_device_ids=true, to_apply=%add\n}\n"
    )


@pytest.mark.parametrize("spelling,groups", MESH_GROUPS)
def test_replica_group_spellings(spelling, groups):
    (reduce,) = collectives(one_all_reduce(spelling))
    assert reduce.groups == groups


def xla_runs_groups(hlo_text: str) -> set[tuple[int, ...]]:
    """The groups an all-reduce module's replica groups mean to XLA itself: the module is
    compiled for 8 partitions and run with one-hot inputs, so each device's sum names its
    group. Uses jaxlib internals (jax is pinned below 0.11); the HLO -> StableHLO step
    drops a mesh's device_ids, so only meshes in iota order can be checked this way."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

    module = xc.hlo.hlo_module_from_text(hlo_text)
    stablehlo = _jax.mlir.hlo_to_stablehlo(module.as_serialized_hlo_module_proto())
    with mlir.make_ir_context():
        code = mlir.module_to_bytecode(ir.Module.parse(stablehlo))
    options = xc.CompileOptions()
    build = options.executable_build_options
    build.num_replicas, build.num_partitions, build.use_spmd_partitioning = 1, 8, True
    build.device_assignment = xc.DeviceAssignment.create(np.arange(8).reshape(1, 8))
    devices = jax.devices()[:8]
    executable = devices[0].client.compile_and_load(code, xc.DeviceList(tuple(devices)), options)
    one_hot = [jax.device_put(np.eye(8, dtype=np.float32)[d], devices[d]) for d in range(8)]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P())
    inputs = jax.make_array_from_single_device_arrays((8,), sharding, one_hot)
    (sums,) = executable.execute_sharded([inputs]).disassemble_into_single_device_arrays()
    return {tuple(int(i) for i in np.flatnonzero(np.asarray(s))) for s in sums}


@pytest.mark.parametrize(
    "spelling",
    [s for s, _ in MESH_GROUPS if s.startswith("mesh['") and "device_ids" not in s]
    + ["mesh['a'=2,'b'=2,'c'=2] {'c','a'}", "mesh['a'=4,'b'=2] {'b','a':(2)2}"],
)
def test_mesh_spellings_mean_what_xla_runs(spelling):
    text = one_all_reduce(spelling)
    (reduce,) = collectives(text)
    assert {tuple(sorted(g)) for g in reduce.groups} == xla_runs_groups(text)


ASYNC_AND_LOOP = """\
HloModule m, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %call = f32[8]{0} call(%v), to_apply=%inner
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %call)
}

%inner (v.1: f32[8]) -> f32[8] {
  %v.1 = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%v.1), channel_id=3, replica_groups={}, to_apply=%add
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%wrapped (w: bf16[4,4]) -> bf16[4,4] {
  %w = bf16[4,4]{1,0} parameter(0)
  ROOT %a2a = bf16[4,4]{1,0} all-to-all(%w), channel_id=5, replica_groups=[1,4]<=[4], dimensions={0}
}

ENTRY %main (a: f32[2,8], b: f32[8]) -> f32[8] {
  %a = f32[2,8]{1,0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(f32[2,8]{1,0} %a), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %ars = f32[8]{0} all-reduce-start(%b), channel_id=2, replica_groups={{0,2},{1,3}}, use_global_device_ids=true, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%ard), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %cpd)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %x = bf16[4,4]{1,0} constant({...})
  %as = ((bf16[4,4]{1,0}), bf16[4,4]{1,0}) async-start(%x), calls=%wrapped
  %ad = bf16[4,4]{1,0} async-done(%as)
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_async_starts_wrapped_ops_and_ops_called_from_a_loop():
    everything = (tuple(range(4)),)
    assert collectives(ASYNC_AND_LOOP) == [
        # inside %inner, called from the while body; {} is every device
        Collective("all-reduce", 32, 32, everything, in_loop=True, name="ar"),
        # inside the async-start's wrapped computation; bf16 [4, 4]
        Collective("all-to-all", 32, 32, everything, name="a2a"),
        # the -start ops, their operands' shapes printed inline or looked up
        Collective("all-gather", 64, 256, everything, name="ags"),
        Collective("all-reduce", 32, 32, ((0, 2), (1, 3)), name="ars"),
        Collective("collective-permute", 32, 32, ((0, 1), (1, 2), (2, 3), (3, 0)), name="cps"),
    ]


def test_unreadable_or_unmodelled_collectives_are_refused():
    with pytest.raises(HloParseError, match="replica groups"):
        collectives(one_all_reduce("something{else}"))
    ragged = one_all_reduce("{}").replace("all-reduce(", "ragged-all-to-all(")
    with pytest.raises(HloParseError, match="not modelled"):
        collectives(ragged)
    with pytest.raises(HloParseError, match="unknown element type"):
        shape_bytes("q7[3]")


def test_shape_bytes():
    assert shape_bytes("f32[4,2]{1,0}") == 32
    assert shape_bytes("(f32[8,16]{1,0}, bf16[4]{0}, /*index=2*/s32[])") == 512 + 8 + 4
    assert shape_bytes("pred[3]") == 3
    assert shape_bytes("s4[3]") == 2  # packed, rounded up
    assert shape_bytes("f8e4m3fn[10]") == 10
    assert shape_bytes("f32[<=6,2]") == 48


# -- predicting DCN traffic ---------------------------------------------------------------------


def op(kind, groups, operand=0, result=0):
    return Collective(kind, operand, result, tuple(tuple(g) for g in groups))


@pytest.mark.parametrize(
    "collective,bytes_,messages",
    [
        # 2 + 2 devices; each sends 100 bytes to each of the 2 members on the other slice
        (op("all-to-all", [(0, 1, 2, 3)], operand=400), 8 * 100, 8),
        # only the pairs that change slice send: (1, 2) and (3, 0)
        (op("collective-permute", [(0, 1), (1, 2), (2, 3), (3, 0)], operand=10), 20, 2),
        # ring 0->1->2->3->0 crosses at 1->2 and 3->0: 2 links x 3 steps
        (op("all-gather", [(0, 1, 2, 3)], operand=10), 2 * 3 * 10, 6),
        # listed in the order 0, 2, 1, 3 every link of the ring crosses
        (op("all-gather", [(0, 2, 1, 3)], operand=10), 4 * 3 * 10, 12),
        (op("reduce-scatter", [(0, 1, 2, 3)], operand=40, result=10), 2 * 3 * 10, 6),
        # 2 links x 2(n-1) = 6 steps of 40/4 bytes
        (op("all-reduce", [(0, 1, 2, 3)], operand=40, result=40), 2 * 6 * 10, 12),
        (op("all-reduce", [(0, 1), (2, 3)], operand=40, result=40), 0, 0),
        (op("all-gather", [(0,), (1,), (2,), (3,)], operand=40, result=40), 0, 0),
    ],
)
def test_predict_by_hand(collective, bytes_, messages):
    traffic = predict([collective], [0, 0, 1, 1])
    assert (traffic.bytes, traffic.messages) == (bytes_, messages)
    assert traffic.by_kind == ((collective.kind, bytes_, messages),)


def test_predict_sums_over_collectives_and_reports_each_kind():
    program = [
        op("all-reduce", [(0, 1, 2, 3)], operand=40, result=40),
        op("all-to-all", [(0, 2), (1, 3)], operand=8),
        op("all-reduce", [(0, 1), (2, 3)], operand=40, result=40),
    ]
    assert predict(program, [0, 0, 1, 1]) == DcnTraffic(
        bytes=120 + 16, messages=12 + 4, by_kind=(("all-reduce", 120, 12), ("all-to-all", 16, 4))
    )
    assert predict([], [0]) == DcnTraffic(0, 0, ())
    with pytest.raises(ValueError, match="device 3"):
        predict(program, [0, 0, 1])


def test_predict_on_compiled_programs_with_slices_along_the_major_axis():
    # psum over "a" (across slices) of 32 bytes: 4 groups of 2, each a ring of 2 crossing
    # links x 2 steps of 16 bytes. psum over "b" stays in the slices.
    across = predict(collectives(shard_map_text("psum_dcn")), TWO_SLICES)
    assert (across.bytes, across.messages) == (4 * 2 * 2 * 16, 4 * 2 * 2)
    assert predict(collectives(shard_map_text("psum")), TWO_SLICES).bytes == 0
    # all_to_all over "a": each device sends half of its 64 bytes to the other slice.
    assert predict(collectives(shard_map_text("all_to_all")), TWO_SLICES).bytes == 8 * 32


@pytest.mark.parametrize(
    "spec,gang",
    [
        (MeshSpec.build({"expert": 2}, {"fsdp": 4}), GangShape(2, 1, 4)),
        (MeshSpec.build({"expert": 2}, {"expert": 4}), GangShape(2, 1, 4)),
        (MeshSpec.build({"data": 2, "expert": 2}, {"expert": 2}), GangShape(4, 1, 2)),
        (MeshSpec.build({"data": 2}, {"model": 2, "data": 2}), GangShape(2, 1, 4)),
    ],
)
def test_slices_of_mesh_agree_with_the_device_grid(spec, gang):
    grid = spec.device_grid(gang)
    assert slices_of_mesh(spec) == [int(d) // gang.chips_per_slice for d in grid.flat]


def test_slices_of_mesh_by_hand():
    assert slices_of_mesh(MeshSpec.build({"expert": 2}, {"fsdp": 4})) == TWO_SLICES
    # an ICI axis of 2, then a hybrid axis of 2 x 2: position (i, j) is on slice j // 2
    spec = MeshSpec((MeshAxis("m", ici=2), MeshAxis("e", dcn=2, ici=2)))
    assert slices_of_mesh(spec) == [0, 0, 1, 1] * 2


@pytest.mark.parametrize("strategy", ["flat", "hierarchical"])
def test_all_to_all_prediction_matches_the_moe_layers_shape_model(strategy):
    # Experts over 2 slices ("expert", DCN) x 4 chips ("fsdp", ICI); 64 tokens in groups of
    # 8, E=8 experts of D=8, H=16: the compiled forward's all-to-alls (dispatch and
    # combine) against `predict_dcn_traffic`, which counts both.
    spec, gang = MeshSpec.build({"expert": 2}, {"fsdp": 4}), GangShape(2, 1, 4)
    mesh = Mesh(np.array(jax.devices(), dtype=object)[spec.device_grid(gang)], spec.names)
    ep = ExpertParallelism(("expert", "fsdp"), strategy=strategy)
    cfg = MoELayerConfig(k=2, capacity_factor=1.0, group_size=8)
    rng = np.random.default_rng(0)
    params = {
        "router": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
        "w1": jnp.asarray(rng.normal(size=(8, 8, 16)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 16, 8)), jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    layer = jax.jit(
        lambda p, x: sharded_moe_layer(p, x, cfg, mesh, ep),
        compiler_options={"xla_backend_optimization_level": 0},
    )
    found = collectives(layer.lower(params, x).compile().as_text())
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert len(a2a) == (2 if strategy == "flat" else 4)
    expected = predict_dcn_traffic(spec, ep, cfg, tokens=64, d_model=8, num_experts=8)
    traffic = predict(a2a, slices_of_mesh(spec))
    assert (traffic.bytes, traffic.messages) == (expected.bytes, expected.messages)
    # By hand (tests/unit/test_moe_sharded.py): 2048 bytes either way, 64 vs 16 messages.
    assert (traffic.bytes, traffic.messages) == (2048, 64 if strategy == "flat" else 16)


# -- reading ss ---------------------------------------------------------------------------------

SS_SAMPLE = """\
ESTAB 0      0               127.0.0.1:51114          127.0.0.1:40161 users:(("python",pid=975,fd=57))
\t bbr wscale:10,10 rto:212 rtt:8.539/14.35 mss:62976 cwnd:18 bytes_sent:120002 bytes_retrans:2452 bytes_acked:117551 bytes_received:8850 segs_out:57 segs_in:59 data_segs_out:27 data_segs_in:36 bbr:(bw:83967979976bps,mrtt:0.006) send 1062014756bps
ESTAB 0      0               127.0.0.1:40161          127.0.0.1:51114 users:(("ray::HostWorker",pid=15619,fd=55),("child",pid=15700,fd=55))
\t cubic wscale:7,7 rto:204 bytes_acked:8851 bytes_received:117550 data_segs_out:36
ESTAB 0      0      [::ffff:127.0.0.1]:34168 [::ffff:127.0.0.1]:42493 users:(("raylet",pid=1256,fd=23))
\t bbr wscale:10,10 rto:204 bytes_sent:861 bytes_acked:862 data_segs_out:6
ESTAB 0      0                   [::1]:8080               [::1]:50000
\t cubic wscale:7,7 rto:204 rtt:0.1/0.05 mss:32768
SYN-SENT 0   1               127.0.0.1:50001          127.0.0.1:9
TIME-WAIT 0  0          [fe80::1]%eth0:22          [fe80::2]%eth0:40000
\t
"""


def test_parse_ss():
    assert parse_ss(SS_SAMPLE) == [
        Socket("127.0.0.1:51114", "127.0.0.1:40161", (975,), 117551, 8850, 27),
        Socket("127.0.0.1:40161", "127.0.0.1:51114", (15619, 15700), 8851, 117550, 36),
        Socket("127.0.0.1:34168", "127.0.0.1:42493", (1256,), 862, 0, 6),  # IPv4-mapped
        Socket("[::1]:8080", "[::1]:50000"),  # no owner, no counters
        Socket("127.0.0.1:50001", "127.0.0.1:9"),  # no info line at all
        Socket("[fe80::1]:22", "[fe80::2]:40000"),  # interface scope dropped
    ]
    assert parse_ss(SS_SAMPLE)[1].pid == 15619
    assert parse_ss(SS_SAMPLE)[3].pid is None
    # Given a state filter, ss leaves the State column out.
    assert parse_ss('0 0 127.0.0.1:1 127.0.0.1:2 users:(("p",pid=7,fd=3))\n') == [
        Socket("127.0.0.1:1", "127.0.0.1:2", (7,))
    ]
    assert parse_ss("") == []


def connection(a: str, b: str, pid_a: int, pid_b: int, a_sent: int, b_sent: int):
    """Both ends of a connection between a and b, each having sent that many bytes in
    segments of 10."""
    return [
        Socket(a, b, (pid_a,), a_sent, b_sent, a_sent // 10),
        Socket(b, a, (pid_b,), b_sent, a_sent, b_sent // 10),
    ]


def test_cross_slice_bytes_counts_each_direction_once_by_its_sender():
    slice_of_pid = {1: 0, 2: 0, 3: 1}
    sockets = (
        connection("h:1", "h:2", 1, 2, 1000, 2000)  # same slice
        + connection("h:3", "h:4", 1, 3, 300, 50)  # across, both ways
        + connection("h:5", "h:6", 3, 99, 7000, 7000)  # 99 is no worker
        + [Socket("h:7", "h:8", (3,), 900, 0, 90)]  # the other end is not listed
        + connection("h:9", "h:10", 42, 3, 10, 20)[1:]  # the other end has another owner
    )
    assert cross_slice_bytes(sockets, slice_of_pid) == (350, 35)
    # A socket shared by a non-worker and a worker belongs to the worker.
    shared = [
        Socket("h:1", "h:2", (99, 1), 40, 0, 4),
        Socket("h:2", "h:1", (3,), 0, 40, 0),
    ]
    assert cross_slice_bytes(shared, slice_of_pid) == (40, 4)


def test_the_meter_adds_what_grew_and_survives_closed_and_reused_connections():
    slice_of_pid = {1: 0, 2: 1}
    reads = iter(
        [
            connection("h:1", "h:2", 1, 2, 100, 0),
            connection("h:1", "h:2", 1, 2, 150, 20) + connection("h:3", "h:4", 1, 2, 10, 0),
            connection("h:3", "h:4", 1, 2, 30, 0),  # h:1-h:2 closed: its 170 stay counted
            connection("h:1", "h:2", 1, 2, 40, 0) + connection("h:3", "h:4", 1, 2, 30, 0),
            # h:1-h:2 closed and opened again between reads: lower counters, a new start
            connection("h:1", "h:2", 1, 2, 5, 0) + connection("h:3", "h:4", 1, 2, 30, 0),
        ]
    )
    meter = DcnMeter(slice_of_pid, sockets=lambda: next(reads))
    assert meter.read() == (100, 10)
    assert meter.read() == (180, 18)
    assert meter.read() == (200, 20)
    assert meter.read() == (240, 24)
    assert meter.read() == (245, 24)


# -- measuring live processes -------------------------------------------------------------------

# A process that listens on loopback and, on command, connects to others and sends bytes;
# it reports how many connections it accepted and how many bytes it received.
PEER = r"""
import socket, sys, threading
server = socket.create_server(("127.0.0.1", 0))
lock = threading.Lock()
counts = [0, 0]  # accepted, received
def drain(conn):
    while data := conn.recv(1 << 16):
        with lock:
            counts[1] += len(data)
def accept():
    while True:
        conn, _ = server.accept()
        with lock:
            counts[0] += 1
        threading.Thread(target=drain, args=(conn,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
print(server.getsockname()[1], flush=True)
out = {}
for line in sys.stdin:
    command, *args = line.split()
    if command == "connect":
        out[args[0]] = socket.create_connection(("127.0.0.1", int(args[0])))
    elif command == "send":
        out[args[0]].sendall(b"x" * int(args[1]))
    with lock:
        print(*counts, flush=True)
"""


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid
        self.port = int(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"peer {self.pid} did not answer (exit code {self.proc.poll()})"
        return line

    def ask(self, command: str) -> tuple[int, int]:
        """Runs a command; (connections accepted, bytes received) after it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        accepted, received = self._line().split()
        return int(accepted), int(received)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def test_meter_measures_bytes_sent_between_processes_of_different_slices():
    read_sockets()  # fails here, clearly, if ss is missing
    peers: list[Peer] = []
    try:
        peers += [Peer(), Peer(), Peer()]
        a, b, c = peers  # a and b on slice 0, c on slice 1
        a.ask(f"connect {b.port}")
        a.ask(f"connect {c.port}")
        c.ask(f"connect {b.port}")
        # Only once accepted does the receiving end belong to (show the pid of) its process.
        wait_until(
            lambda: b.ask("status") == (2, 0) and c.ask("status") == (1, 0),
            timeout_s=10,
            what="the peers to accept their connections",
        )
        meter = DcnMeter({a.pid: 0, b.pid: 0, c.pid: 1})
        before = meter.read()

        a.ask(f"send {b.port} 100000")  # inside slice 0: not counted
        a.ask(f"send {c.port} 30000")
        c.ask(f"send {b.port} 50000")
        wait_until(
            lambda: b.ask("status") == (2, 150000) and c.ask("status") == (1, 30000),
            timeout_s=10,
            what="the peers to receive every byte",
        )
        # Received is not yet acknowledged: wait for the senders' kernels to see the acks.
        expected = 30000 + 50000
        after = wait_until(
            lambda: (now := meter.read())[0] - before[0] >= expected and now,
            timeout_s=5,
            what=f"{expected} cross-slice bytes to be acknowledged",
        )
        assert after[0] - before[0] == expected
        assert after[1] - before[1] >= 2  # at least one data segment per connection
        # Over the connections' lifetimes: the same, plus one per SYN of the 2 connections'
        # 4 ends.
        total, _ = cross_slice_bytes(read_sockets(), {a.pid: 0, b.pid: 0, c.pid: 1})
        assert expected <= total <= expected + 4
    finally:
        for peer in peers:
            peer.stop()
