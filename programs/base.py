"""The training-program interface, and the generic pieces built on it: config parsing,
sharded (exportable) init and train-step functions, and a one-device reference trainer.

A program (`programs/<name>/__init__.py: PROGRAM`) says what to train: its config, its
parameters and how they are split over a mesh, its optimizer, its loss and how each host
builds its rows of a global batch. The job runner builds `make_train_fns` against the
gang's `AbstractMesh` on the controller, exports the flat forms (`make_flat_train_fns`)
and runs them on the workers; each worker calls `host_batch` for its own rows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from slicewise.common.errors import InvalidRequestError

Params = Any
Batch = dict[str, Any]
C = TypeVar("C")

METRICS = ("grad_norm", "learning_rate", "loss")


class ConfigError(InvalidRequestError):
    """A config that cannot be built or does not fit the mesh; the message says what to change."""


class UnknownProgramError(InvalidRequestError):
    """No installed program has the requested name."""


@dataclasses.dataclass(frozen=True)
class ParallelAxes:
    """Which mesh axes carry which kind of parallelism, with their sizes.

    `data` axes split the batch only; `fsdp` splits the batch too and also one dimension
    of every large weight (ZeRO-3 style); `tensor` splits weights Megatron-style; `expert`
    splits the batch and, in programs with experts, the experts (expert parallelism). An
    axis of the mesh named in none of them replicates everything. Sizes come from the
    mesh: `make_train_fns` binds them, and `for_mesh` builds bound axes directly. `dcn`
    says how many slices each axis spans (1 for an axis inside a slice; absent: 1), for
    programs that count what crosses slices.
    """

    data: tuple[str, ...] = ("data",)
    fsdp: str | None = None
    tensor: str | None = None
    sizes: tuple[tuple[str, int], ...] = ()
    expert: str | None = None
    dcn: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        named = [
            *self.data,
            *([self.fsdp] if self.fsdp and self.fsdp not in self.data else []),
            *([self.tensor] if self.tensor else []),
            *([self.expert] if self.expert else []),
        ]
        if len(set(named)) != len(named):
            raise ConfigError(
                f"parallel axes repeat: data={self.data}, fsdp={self.fsdp!r}, "
                f"tensor={self.tensor!r}, expert={self.expert!r}; the tensor and expert axes "
                "must differ from the others"
            )
        known = dict(self.sizes)
        missing = [n for n in named if n not in known]
        if self.sizes and missing:
            raise ConfigError(
                f"parallel axes {missing} are not axes of the mesh, whose axes are {list(known)}"
            )

    @classmethod
    def for_mesh(
        cls,
        mesh: Any,
        data: Sequence[str] = ("data",),
        fsdp: str | None = None,
        tensor: str | None = None,
        expert: str | None = None,
        dcn: Mapping[str, int] | None = None,
    ) -> ParallelAxes:
        """Binds axis names to the sizes of `mesh` (a `Mesh` or an `AbstractMesh`); `dcn`
        gives the slices each axis spans (default: none spans slices)."""
        sizes = tuple((str(n), int(s)) for n, s in mesh.shape.items())
        spans = tuple(sorted((str(n), int(d)) for n, d in (dcn or {}).items()))
        return cls(tuple(data), fsdp, tensor, sizes, expert, spans)

    def bind(self, mesh: Any) -> ParallelAxes:
        """These axes with the sizes of `mesh`."""
        sizes = tuple((str(n), int(s)) for n, s in mesh.shape.items())
        return self if dict(self.sizes) == dict(sizes) else dataclasses.replace(self, sizes=sizes)

    def size(self, name: str | None) -> int:
        """The size of a mesh axis; 1 for None (no such parallelism)."""
        return 1 if name is None else dict(self.sizes)[name]

    def slices(self, name: str | None) -> int:
        """How many slices a mesh axis spans (its DCN part); 1 for None."""
        return 1 if name is None else dict(self.dcn).get(name, 1)

    @property
    def batch(self) -> tuple[str, ...]:
        """The axes the batch dimension is split over: the data axes, expert, then fsdp."""
        extra = [a for a in (self.expert, self.fsdp) if a and a not in self.data]
        return self.data + tuple(extra)

    @property
    def batch_ways(self) -> int:
        return math.prod(self.size(n) for n in self.batch)


class TrainingProgram(ABC, Generic[C]):
    """What a trainable program provides; one instance per program, stateless.

    Every method takes the config explicitly so that the instance can be shared.
    """

    name: ClassVar[str]
    config_type: ClassVar[type]

    def make_config(self, overrides: Mapping[str, str] | None = None) -> C:
        """The default config with `--set key=value` overrides applied (see `parse_config`)."""
        return parse_config(self.config_type, overrides or {})

    @abstractmethod
    def init_params(self, config: C, key: jax.Array) -> Params:
        """Fresh parameters (a pytree of float arrays) from a `jax.random.PRNGKey`."""

    @abstractmethod
    def learning_rate(self, config: C) -> optax.Schedule:
        """The learning-rate schedule `optimizer` uses, as a function of the update count."""

    @abstractmethod
    def optimizer(self, config: C) -> optax.GradientTransformation:
        """The optimizer; its state must carry optax's usual `count` of updates done."""

    @abstractmethod
    def loss(self, config: C, params: Params, batch: Batch) -> jax.Array:
        """The scalar training loss of one global batch."""

    def loss_and_stats(
        self,
        config: C,
        params: Params,
        batch: Batch,
        mesh: Any = None,
        axes: ParallelAxes | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss and statistics the step reports beside it (arrays of fixed shape, e.g.
        how many tokens each expert served), traced on `mesh` with `axes` when the step is
        sharded (None on one device). A program whose layers place their own collectives
        (`shard_map`) uses them; the default is `loss` with no statistics, and XLA splits it.
        """
        del mesh, axes
        return self.loss(config, params, batch), {}

    @abstractmethod
    def batch_spec(self, config: C) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of the global batch; every array's dimension 0 is the batch."""

    @abstractmethod
    def tokens_per_step(self, config: C) -> int:
        """How many tokens one step trains on (throughput reports divide it by the step
        time the workers measured)."""

    @abstractmethod
    def host_batch(
        self, config: C, step: int, host_index: int, num_hosts: int
    ) -> dict[str, np.ndarray]:
        """Rows `host_rows(B, host_index, num_hosts)` of the global batch of `step`,
        built without building the rest of it."""

    @abstractmethod
    def param_partition(self, config: C, params_shape: Params, axes: ParallelAxes) -> Any:
        """A `PartitionSpec` for every parameter (a pytree like `params_shape`).

        Raises:
            ConfigError: a sharded dimension does not divide over its mesh axis.
        """

    def global_batch(self, config: C, step: int) -> dict[str, np.ndarray]:
        """The whole batch of `step`, for references and tests."""
        return self.host_batch(config, step, 0, 1)

    def data_fingerprint(self, config: C) -> str:
        """A digest of the data `host_batch` reads, so that hosts can check they agree
        before training ("" when the data is synthetic)."""
        return ""

    def seed(self, config: C) -> int:
        """The seed of the initial parameters (`init_fn(jax.random.PRNGKey(seed))`)."""
        return int(getattr(config, "seed", 0))


def get_program(name: str) -> TrainingProgram[Any]:
    """The `PROGRAM` of module `programs.<name>`.

    Raises:
        UnknownProgramError: there is no such module, or it defines no PROGRAM.
    """
    module = None
    if name.isidentifier() and name not in ("base", "corpus"):
        try:
            module = importlib.import_module(f"programs.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"programs.{name}":
                raise
    program = getattr(module, "PROGRAM", None)
    if not isinstance(program, TrainingProgram):
        raise UnknownProgramError(
            f"no training program named {name!r}; known programs: {known_programs()}"
        )
    return program


def known_programs() -> list[str]:
    """Names of the modules under `programs/` that define a PROGRAM."""
    import programs

    names = []
    for info in pkgutil.iter_modules(programs.__path__):
        if info.name in ("base", "corpus"):
            continue
        module = importlib.import_module(f"programs.{info.name}")
        if isinstance(getattr(module, "PROGRAM", None), TrainingProgram):
            names.append(info.name)
    return sorted(names)


def parse_config(config_type: type[C], overrides: Mapping[str, str]) -> C:
    """Builds `config_type()` with string overrides converted by the fields' types.

    Supports int, float, bool (true/false, yes/no, on/off, 1/0), str and tuple[int, ...]
    (comma-separated).

    Raises:
        ConfigError: an unknown key (the message lists the valid ones), a value that does
            not parse, or a config that its own validation refuses.
    """
    fields = {f.name: f for f in dataclasses.fields(config_type)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} for {config_type.__name__}; valid keys: "
            f"{', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(config_type)
    values = {}
    for key, text in overrides.items():
        try:
            values[key] = _convert(hints[key], str(text).strip())
        except ValueError:
            raise ConfigError(
                f"config key {key!r} expects {_type_name(hints[key])}"
                + (" (a finite number)" if hints[key] is float else "")
                + f", got {text!r}"
            ) from None
    try:
        return config_type(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {config_type.__name__}: {exc}") from None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(kind: Any, text: str) -> Any:
    if kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(text)
    if kind is float:
        value = float(text)
        if not math.isfinite(value):  # "inf", "nan", "1e999": no learning rate or clip
            raise ValueError(text)
        return value
    if kind in (int, str):
        return kind(text)
    if typing.get_origin(kind) is tuple:
        (item, *rest) = typing.get_args(kind)
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return tuple(_convert(item, p) for p in parts)
    raise ValueError(f"unsupported field type {kind}")


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is tuple:
        return f"comma-separated {typing.get_args(kind)[0].__name__}s"
    return getattr(kind, "__name__", str(kind))


def host_rows(batch_size: int, host_index: int, num_hosts: int) -> tuple[int, int]:
    """The contiguous rows [lo, hi) of a global batch that host `host_index` builds.

    Raises:
        ConfigError: the hosts do not split the batch evenly, or the index is out of range.
    """
    if num_hosts < 1 or not 0 <= host_index < num_hosts:
        raise ConfigError(f"host index {host_index} is not in [0, {num_hosts})")
    if batch_size % num_hosts:
        raise ConfigError(
            f"batch_size={batch_size} does not split evenly over {num_hosts} hosts; use a "
            f"multiple of {num_hosts}"
        )
    rows = batch_size // num_hosts
    return host_index * rows, (host_index + 1) * rows


def check_partition(params_shape: Params, specs: Any, axes: ParallelAxes) -> None:
    """Raises ConfigError unless every sharded dimension divides over its mesh axes."""
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    paths = jax.tree_util.tree_flatten_with_path(params_shape)[0]
    for (path, leaf), spec in zip(paths, flat_specs, strict=True):
        for dim, entry in enumerate(spec):
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            ways = math.prod(axes.size(n) for n in names)
            if leaf.shape[dim] % ways:
                raise ConfigError(
                    f"parameter {jax.tree_util.keystr(path)} of shape {leaf.shape}: dimension "
                    f"{dim} ({leaf.shape[dim]}) does not split {ways} ways over mesh axes "
                    f"{list(names)}"
                )


def train_step(
    program: TrainingProgram[C],
    config: C,
    optimizer: optax.GradientTransformation,
    params: Params,
    opt_state: Any,
    batch: Batch,
    *,
    mesh: Any = None,
    axes: ParallelAxes | None = None,
) -> tuple[Params, Any, Batch]:
    """One optimizer step; metrics are float32: the scalars `METRICS` (loss, grad_norm,
    learning_rate) and the program's statistics (`loss_and_stats`).

    The same function runs sharded (`make_train_fns`, with the mesh and axes) and on one
    device (`reference_train`), so the two differ only in how the work is split.
    """
    counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    if not counts:
        raise ConfigError(f"program {program.name!r}: its optimizer state has no update count")
    count = counts[0][1]

    def loss_fn(params: Params) -> tuple[jax.Array, dict[str, jax.Array]]:
        return program.loss_and_stats(config, params, batch, mesh, axes)

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    clash = sorted(set(stats) & set(METRICS))
    if clash:
        raise ConfigError(f"program {program.name!r}: statistics {clash} shadow step metrics")
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {
        **stats,
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": program.learning_rate(config)(count),
    }
    return params, opt_state, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def _init(
    program: TrainingProgram[C], config: C, optimizer: optax.GradientTransformation, key: jax.Array
) -> tuple[Params, Any]:
    params = program.init_params(config, key)
    return params, optimizer.init(params)


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """Shapes and shardings of everything a train step touches, for one config and mesh."""

    params: Params  # ShapeDtypeStructs with shardings
    opt_state: Any  # likewise
    batch: dict[str, jax.ShapeDtypeStruct]
    key: jax.ShapeDtypeStruct

    @property
    def state_treedef(self) -> Any:
        return jax.tree.structure((self.params, self.opt_state))

    @property
    def state(self) -> list[jax.ShapeDtypeStruct]:
        """The leaves of (params, opt_state), in the order the flat functions use."""
        return jax.tree.leaves((self.params, self.opt_state))

    def flatten_state(self, params: Params, opt_state: Any) -> list[Any]:
        return jax.tree.leaves((params, opt_state))

    def unflatten_state(self, leaves: Sequence[Any]) -> tuple[Params, Any]:
        return jax.tree.unflatten(self.state_treedef, list(leaves))


def train_layout(
    program: TrainingProgram[C], config: C, mesh: Any, axes: ParallelAxes
) -> TrainLayout:
    """Shardings of params (per `param_partition`), optimizer state (like the params it
    tracks; counters replicated), the batch (dim 0 over `axes.batch`) and the init key.

    Raises:
        ConfigError: the axes are not the mesh's, or the config does not divide the mesh.
    """
    axes = axes.bind(mesh)
    optimizer = program.optimizer(config)
    params_shape, opt_shape = jax.eval_shape(
        functools.partial(_init, program, config, optimizer), jax.random.PRNGKey(0)
    )
    specs = program.param_partition(config, params_shape, axes)
    check_partition(params_shape, specs, axes)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    opt_specs = optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_shape,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=is_spec,
    )

    def with_sharding(shape: jax.ShapeDtypeStruct, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=NamedSharding(mesh, spec))

    batch_spec = program.batch_spec(config)
    for name, leaf in batch_spec.items():
        if leaf.shape[0] % axes.batch_ways:
            raise ConfigError(
                f"batch array {name!r} has {leaf.shape[0]} rows, which the {axes.batch_ways}-"
                f"way data parallelism over mesh axes {list(axes.batch)} does not divide; "
                f"use a batch size that is a multiple of {axes.batch_ways}"
            )
    batch_pspec = P(axes.batch or None)
    return TrainLayout(
        params=jax.tree.map(with_sharding, params_shape, specs),
        opt_state=jax.tree.map(with_sharding, opt_shape, opt_specs),
        batch={k: with_sharding(v, batch_pspec) for k, v in batch_spec.items()},
        key=with_sharding(jax.ShapeDtypeStruct((2,), jnp.uint32), P()),
    )


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda s: s.sharding, tree)


@functools.lru_cache(maxsize=16)
def _build(
    program: TrainingProgram[C], config: C, mesh: Any, axes: ParallelAxes
) -> tuple[TrainLayout, Callable[..., Any], Callable[..., Any]]:
    # Cached so that building the same job's functions again reuses their compilations.
    axes = axes.bind(mesh)
    layout = train_layout(program, config, mesh, axes)
    optimizer = program.optimizer(config)
    params_sh, opt_sh = _shardings(layout.params), _shardings(layout.opt_state)
    init_fn = jax.jit(
        functools.partial(_init, program, config, optimizer),
        in_shardings=(layout.key.sharding,),
        out_shardings=(params_sh, opt_sh),
    )
    step_fn = jax.jit(
        functools.partial(train_step, program, config, optimizer, mesh=mesh, axes=axes),
        in_shardings=(params_sh, opt_sh, _shardings(layout.batch)),
        out_shardings=(params_sh, opt_sh, _metric_shardings(mesh)),
    )
    return layout, init_fn, step_fn


def _metric_shardings(mesh: Any) -> NamedSharding:
    # Replicated, as a prefix of the whole metrics dict (whatever statistics it holds).
    return NamedSharding(mesh, P())


def make_train_fns(
    program: TrainingProgram[C], config: C, mesh: Any, axes: ParallelAxes
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Jitted `init_fn(key) -> (params, opt_state)` and
    `step_fn(params, opt_state, batch) -> (params, opt_state, metrics)` on `mesh`.

    `mesh` may be an `AbstractMesh` (for export) or a concrete `Mesh`; `axes` are bound to
    its sizes. `key` is a raw `jax.random.PRNGKey` (uint32[2]). Metrics are replicated
    float32: the `METRICS` scalars and the program's statistics. optax states are NamedTuples, which `Exported.serialize()` refuses:
    to export, use `make_flat_train_fns`.

    Raises:
        ConfigError: the axes are not the mesh's, or the config does not divide the mesh.
    """
    _, init_fn, step_fn = _build(program, config, mesh, axes)
    return init_fn, step_fn


@dataclasses.dataclass(frozen=True)
class FlatTrainFns:
    """The train functions with (params, opt_state) passed as one flat list of arrays, so
    that their exports serialize without registering optax's types anywhere.

    `init(key) -> state` and `step(state, batch) -> (state, metrics)`, where `state` is
    the `layout.state`-ordered leaves, `batch` a dict and `metrics` a dict of float32
    arrays (`METRICS` scalars and the program's statistics). Flattened for a call: inputs
    are the state leaves then the batch arrays by sorted key; outputs the state leaves then
    the metrics by sorted key.
    """

    init: Callable[..., Any]
    step: Callable[..., Any]
    layout: TrainLayout

    def export(self, platforms: Sequence[str]) -> tuple[jax.export.Exported, jax.export.Exported]:
        """`jax.export`s of init and step for `platforms`; `.serialize()` works on both."""
        init = jax.export.export(self.init, platforms=platforms)(self.layout.key)
        step = jax.export.export(self.step, platforms=platforms)(
            self.layout.state, self.layout.batch
        )
        return init, step


def make_flat_train_fns(
    program: TrainingProgram[C], config: C, mesh: Any, axes: ParallelAxes
) -> FlatTrainFns:
    """`make_train_fns` with the state flattened to a list; see `FlatTrainFns`."""
    layout, init_fn, step_fn = _build(program, config, mesh, axes)
    state_sh = _shardings(layout.state)

    def flat_init(key: jax.Array) -> list[jax.Array]:
        return layout.flatten_state(*init_fn(key))

    def flat_step(state: list[jax.Array], batch: Batch) -> tuple[list[jax.Array], Batch]:
        params, opt_state, metrics = step_fn(*layout.unflatten_state(state), batch)
        return layout.flatten_state(params, opt_state), metrics

    return FlatTrainFns(
        init=jax.jit(flat_init, in_shardings=(layout.key.sharding,), out_shardings=state_sh),
        step=jax.jit(
            flat_step,
            in_shardings=(state_sh, _shardings(layout.batch)),
            out_shardings=(state_sh, _metric_shardings(mesh)),
        ),
        layout=layout,
    )


@functools.lru_cache(maxsize=4)
def _reference_fns(
    program: TrainingProgram[C], config: C
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    optimizer = program.optimizer(config)
    return (
        jax.jit(functools.partial(_init, program, config, optimizer)),
        jax.jit(functools.partial(train_step, program, config, optimizer)),
    )


def reference_train(program: TrainingProgram[C], config: C, steps: int) -> list[float]:
    """Per-step losses of `steps` steps on one device, unsharded: the equivalence baseline.

    Same init key (`PRNGKey(program.seed(config))`) and data order (`global_batch(step)`
    for step 0, 1, ...) as a sharded run.
    """
    device = jax.devices()[0]
    init, step = _reference_fns(program, config)
    params, opt_state = init(jax.device_put(jax.random.PRNGKey(program.seed(config)), device))
    losses = []
    for s in range(steps):
        batch = jax.device_put(program.global_batch(config, s), device)
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return losses
