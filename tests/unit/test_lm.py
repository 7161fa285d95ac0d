"""The training-program interface and the `lm` program: sharded training against a
one-device reference on 8 CPU devices, export against an AbstractMesh, per-host batches,
config parsing and the errors a person sees."""

import hashlib
from dataclasses import dataclass

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from controller.programs import load_program
from programs.base import (
    METRICS,
    ConfigError,
    ParallelAxes,
    UnknownProgramError,
    get_program,
    host_rows,
    make_flat_train_fns,
    make_train_fns,
    parse_config,
    reference_train,
    train_layout,
)
from programs.corpus import Corpus
from programs.lm import PROGRAM, LMConfig
from slicewise.common.arrays import ArraySpec
from slicewise.common.mesh import GangShape, MeshSpec, ShardingSpec

LM = PROGRAM
SPEC = MeshSpec.build({"data": 2}, {"fsdp": 2, "tensor": 2})
GANG = GangShape(num_slices=2, hosts_per_slice=1, chips_per_host=4)
SMALL = {
    "d_model": "32",
    "n_layers": "2",
    "n_heads": "4",
    "d_ff": "64",
    "seq_len": "32",
    "batch_size": "8",
    "warmup_steps": "5",
    "total_steps": "30",
}


@pytest.fixture(scope="module")
def mesh():
    devices = np.array(jax.devices()[:8], dtype=object)[SPEC.device_grid(GANG)]
    return Mesh(devices, SPEC.names)


def axes_for(mesh):
    return ParallelAxes.for_mesh(mesh, data=("data",), fsdp="fsdp", tensor="tensor")


# -- training -----------------------------------------------------------------------------


def test_sharded_training_over_two_slices_matches_one_device_reference(mesh):
    config = LM.make_config(SMALL)
    steps = 20
    init_fn, step_fn = make_train_fns(LM, config, mesh, axes_for(mesh))
    batch_sharding = train_layout(LM, config, mesh, axes_for(mesh)).batch["tokens"].sharding
    assert batch_sharding.spec == P(("data", "fsdp"))

    params, opt_state = init_fn(jax.random.PRNGKey(config.seed))
    assert params["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert params["layers"]["w_out"].sharding.spec == P(None, "tensor", "fsdp")
    # Adam's moments are split like the weights they track; its counter is replicated.
    adam = opt_state[1][0]
    assert adam.mu["layers"]["wq"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert adam.count.sharding.spec == P()

    losses = []
    for step in range(steps):
        batch = jax.device_put(LM.global_batch(config, step), batch_sharding)
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        assert sorted(metrics) == list(METRICS)
        assert all(m.dtype == np.float32 and m.shape == () for m in metrics.values())
        losses.append(float(metrics["loss"]))

    expected = reference_train(LM, config, steps)
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert losses[-1] < losses[0] - 0.5


def test_flat_train_fns_export_against_abstract_mesh_and_run_on_the_real_one(mesh):
    config = LM.make_config(SMALL)
    flat = make_flat_train_fns(LM, config, SPEC.abstract(), axes_for(mesh))
    init_exp, step_exp = flat.export(platforms=["cpu"])
    step_bytes = step_exp.serialize()

    # The controller describes the artifacts as it would any client's programs.
    init = load_program(init_exp.serialize(), "lm-init", SPEC)
    assert [str(spec) for spec in init.inputs] == [str(ArraySpec.of((2,), np.uint32))]
    assert len(init.outputs) == len(flat.layout.state)
    described = load_program(step_bytes, "lm-step", SPEC)
    assert len(described.inputs) == len(flat.layout.state) + 1
    assert len(described.outputs) == len(flat.layout.state) + len(METRICS)
    assert described.num_devices == 8

    # Deserialized and called as a worker calls it, the step equals the jitted step. (The
    # init artifact runs the same way; compiling it too would only slow this test down.)
    exported = jax.export.deserialize(bytearray(step_bytes))
    init_fn, step_fn = make_train_fns(LM, config, mesh, axes_for(mesh))
    params, opt_state = init_fn(jax.random.PRNGKey(config.seed))
    args = [*flat.layout.flatten_state(params, opt_state), LM.global_batch(config, 0)["tokens"]]
    leaves = [
        jax.device_put(x, s) for x, s in zip(args, exported.in_shardings_jax(mesh), strict=True)
    ]
    state, batch = jax.tree.unflatten(exported.in_tree, leaves)[0]
    new_state, metrics = jax.jit(exported.call)(state, batch)

    params, opt_state, expected = step_fn(params, opt_state, batch)
    assert sorted(metrics) == list(METRICS)
    assert float(metrics["loss"]) == pytest.approx(float(expected["loss"]), rel=1e-6)
    got_params, _ = flat.layout.unflatten_state(new_state)
    np.testing.assert_allclose(got_params["unembed"], params["unembed"], rtol=1e-5)


def test_loss_goes_down_on_one_device():
    # SMALL again: the reference functions compiled for the equivalence test are reused.
    losses = reference_train(LM, LM.make_config(SMALL), 30)
    assert losses[0] == pytest.approx(np.log(256), abs=0.3)
    assert np.mean(losses[-5:]) < losses[0] - 1.5


# -- batches ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_hosts", [2, 4, 8])
def test_host_blocks_concatenate_to_the_global_batch(num_hosts):
    config = LM.make_config(SMALL)
    whole = LM.global_batch(config, 3)["tokens"]
    assert whole.shape == (8, 33) and whole.dtype == np.int32
    blocks = [LM.host_batch(config, 3, h, num_hosts)["tokens"] for h in range(num_hosts)]
    np.testing.assert_array_equal(np.concatenate(blocks), whole)


@pytest.mark.parametrize("gang", [GANG, GangShape(2, 2, 2)], ids=["1host", "2hosts"])
def test_each_process_builds_the_rows_its_devices_hold(gang):
    """A worker asks the controller's sharding math which rows it holds, then builds just
    those blocks with host_batch."""
    config = LM.make_config({**SMALL, "batch_size": "16"})
    whole = LM.global_batch(config, 2)["tokens"]
    batch_dims = ShardingSpec.from_partition_spec(SPEC, (("data", "fsdp"),))
    pieces = batch_dims.process_pieces(whole.shape, gang)
    for indices in pieces.values():
        for index in indices:
            rows = index[0].stop - index[0].start
            block = LM.host_batch(config, 2, index[0].start // rows, 16 // rows)["tokens"]
            np.testing.assert_array_equal(block, whole[index])


def test_batches_depend_on_seed_and_step_only():
    config = LM.make_config(SMALL)
    first = LM.global_batch(config, 0)["tokens"]
    np.testing.assert_array_equal(first, LM.global_batch(config, 0)["tokens"])
    assert not np.array_equal(first, LM.global_batch(config, 1)["tokens"])
    reseeded = LM.make_config({**SMALL, "seed": "1"})
    assert not np.array_equal(first, LM.global_batch(reseeded, 0)["tokens"])
    # The targets are the inputs shifted by one byte: rows are contiguous windows.
    assert first.min() >= 0 and first.max() < 256


def test_a_host_reads_only_its_own_rows(monkeypatch):
    config = LM.make_config({**SMALL, "batch_size": "16"})
    reads = []
    original = Corpus.read

    def spy(self, starts, length):
        reads.append((len(starts), length))
        return original(self, starts, length)

    monkeypatch.setattr(Corpus, "read", spy)
    block = LM.host_batch(config, 5, 2, 4)["tokens"]
    assert reads == [(4, 33)]
    assert block.shape == (4, 33)


def test_hosts_must_split_the_batch_evenly():
    assert host_rows(16, 3, 4) == (12, 16)
    with pytest.raises(ConfigError, match="batch_size=8 does not split evenly over 3 hosts"):
        LM.host_batch(LM.make_config(SMALL), 0, 0, 3)
    with pytest.raises(ConfigError, match="host index 4"):
        host_rows(8, 4, 4)


# -- config -------------------------------------------------------------------------------


def test_make_config_converts_by_field_type():
    config = LM.make_config({"d_model": "64", "learning_rate": "1e-3", "corpus": "/x/*.txt"})
    assert config == LMConfig(d_model=64, learning_rate=1e-3, corpus="/x/*.txt")
    assert LM.make_config({}) == LMConfig()


def test_unknown_keys_are_refused_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['dmodel'\].*d_ff, d_model, "):
        LM.make_config({"dmodel": "64"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": "big"}, "config key 'd_model' expects int, got 'big'"),
        ({"learning_rate": "inf"}, r"'learning_rate' expects float \(a finite number\), got 'inf'"),
        ({"learning_rate": "1e999"}, r"expects float \(a finite number\), got '1e999'"),
        ({"grad_clip": "nan"}, r"'grad_clip' expects float \(a finite number\), got 'nan'"),
        ({"d_model": "100", "n_heads": "3"}, "d_model=100 must be divisible by n_heads=3"),
        ({"seq_len": "0"}, "seq_len=0 must be at least 1"),
        ({"warmup_steps": "500"}, r"warmup_steps=500 must be in \[0, total_steps=200\]"),
    ],
)
def test_bad_values_are_refused_with_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        LM.make_config(overrides)


def test_parse_config_handles_bools_and_int_tuples():
    @dataclass(frozen=True)
    class Config:
        flag: bool = False
        shape: tuple[int, ...] = (1,)

    assert parse_config(Config, {"flag": "yes", "shape": "2, 4,8"}) == Config(True, (2, 4, 8))
    assert parse_config(Config, {"flag": "off"}).flag is False
    with pytest.raises(ConfigError, match="expects bool"):
        parse_config(Config, {"flag": "maybe"})


def test_config_that_does_not_divide_the_mesh_is_refused(mesh):
    heads = LM.make_config({**SMALL, "n_heads": "1"})
    with pytest.raises(
        ConfigError,
        match="n_heads=1 does not divide over the tensor-parallel mesh axis 'tensor' of size 2",
    ):
        make_train_fns(LM, heads, mesh, axes_for(mesh))
    wide = LM.make_config({**SMALL, "d_model": "33", "n_heads": "3"})
    with pytest.raises(ConfigError, match="d_model=33 does not divide over the FSDP"):
        make_train_fns(LM, wide, SPEC.abstract(), axes_for(mesh))
    rows = LM.make_config({**SMALL, "batch_size": "6"})
    with pytest.raises(
        ConfigError,
        match=r"6 rows.*4-way data parallelism over mesh axes "
        r"\['data', 'fsdp'\]",
    ):
        make_train_fns(LM, rows, mesh, axes_for(mesh))


def test_axes_must_name_distinct_axes_of_the_mesh(mesh):
    with pytest.raises(ConfigError, match=r"\['model'\] are not axes of the mesh"):
        ParallelAxes.for_mesh(mesh, data=("data",), tensor="model")
    with pytest.raises(ConfigError, match="repeat"):
        ParallelAxes.for_mesh(mesh, data=("data", "tensor"), tensor="tensor")
    # fsdp may be listed among the data axes too; the batch still splits over it once.
    axes = ParallelAxes.for_mesh(mesh, data=("data", "fsdp"), fsdp="fsdp", tensor="tensor")
    assert axes.batch == ("data", "fsdp") and axes.batch_ways == 4


def test_get_program_finds_lm_and_lists_known_programs():
    assert get_program("lm") is PROGRAM
    assert PROGRAM.name == "lm"
    with pytest.raises(
        UnknownProgramError, match=r"no training program named 'nope'.*\['lm', 'moe'\]"
    ):
        get_program("nope")
    with pytest.raises(UnknownProgramError, match="'corpus'"):
        get_program("corpus")


def test_data_fingerprint_names_the_corpus_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    config = LM.make_config({**SMALL, "corpus": str(tmp_path / "*.txt")})
    assert LM.data_fingerprint(config) == hashlib.sha256(b"x" * 100).hexdigest()
    assert LM.data_fingerprint(LMConfig()) != LM.data_fingerprint(config)


def test_tokens_per_step_and_batch_spec():
    config = LMConfig()
    assert LM.tokens_per_step(config) == config.batch_size * config.seq_len
    spec = LM.batch_spec(config)["tokens"]
    assert spec.shape == (config.batch_size, config.seq_len + 1) and spec.dtype == np.int32
