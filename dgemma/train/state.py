"""`TrainState` and its sharded construction: abstract shapes -> shardings -> jitted init (no host materialization).

    TrainState(params, opt_state, step, rng)
      params     nnx.State of nnx.Param (the model's parameters; `nnx.merge(graphdef, params)` rebuilds the model)
      opt_state  optax state of `Optimizer.tx` (moments follow the parameter shardings; scalars are replicated)
      step       int32 scalar: number of optimizer updates applied (= the checkpoint step)
      rng        uint32 raw key data of the *base* key; step s uses `fold_in(wrap_key_data(rng), s)`, so the noise of a
                 step depends on (seed, step) only, never on how many steps ran before in this process

    graphdef, abstract = abstract_train_state(model_factory, tx, seed)      # shapes only
    shardings = train_state_shardings(abstract, tx, mesh, rules)            # TrainState of NamedSharding (prefix)
    state = init_train_state(model_factory, tx, seed, shardings)            # created directly on the shardings
    target = with_shardings(abstract, shardings)                            # ShapeDtypeStructs for restore

Sharding of the optimizer state follows the parameters through `optax.tree_map_params` (moments get their
parameter's sharding); every non-parameter leaf (Adam's count, ...) is replicated explicitly, which avoids scalars
coming back from a restore with a SingleDeviceSharding (docs/architecture.md §4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma.parallel.rules import get_rules, state_shardings

__all__ = [
    "ModelFactory", "TrainState", "abstract_train_state", "broadcast_prefix", "init_train_state", "replicated",
    "split_params", "train_state_shardings", "with_shardings",
]

ModelFactory = Callable[[nnx.Rngs], nnx.Module]
"""`model_factory(rngs) -> nnx.Module`, e.g. `lambda rngs: Transformer(model_cfg, rngs=rngs)`."""

RNG_STREAM = 1  # fold_in constant separating the training-noise key from the params-init key of the same seed


@flax.struct.dataclass
class TrainState:
    """Everything a step needs and a checkpoint stores (module docstring)."""

    # jax.Arrays in a live state; the same structure also holds an abstract state (ShapeDtypeStructs) or the
    # shardings of one (`train_state_shardings`), hence Any
    params: Any
    opt_state: Any
    step: Any  # int32 scalar
    rng: Any  # the base key's raw data (`key()` wraps it)

    def key(self) -> jax.Array:
        """The base PRNG key (typed)."""
        return jax.random.wrap_key_data(self.rng)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params). Raises if the model holds non-Param state, which `TrainState` would silently drop."""
    graphdef, *states = nnx.split(model, nnx.Param, ...)
    params, rest = states
    if jax.tree.leaves(rest):
        paths = [p for p, _ in nnx.to_flat_state(rest)][:5]
        raise ValueError(f"the model has non-Param state (e.g. {paths}); TrainState only carries nnx.Param")
    return graphdef, params


def _initial_state(model_factory: ModelFactory, tx: optax.GradientTransformation, seed: int):
    model = model_factory(nnx.Rngs(seed))
    graphdef, params = split_params(model)
    rng = jax.random.key_data(jax.random.fold_in(jax.random.key(seed), RNG_STREAM))
    state = TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32), rng=rng)
    return graphdef, state


def abstract_train_state(model_factory: ModelFactory, tx: optax.GradientTransformation,
                         seed: int = 0) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of ShapeDtypeStruct) without allocating anything."""
    box = {}

    def f():
        graphdef, state = _initial_state(model_factory, tx, seed)
        box["graphdef"] = graphdef
        return state

    abstract = jax.eval_shape(f)
    return box["graphdef"], abstract


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def train_state_shardings(abstract: TrainState, tx: optax.GradientTransformation, mesh: Mesh,
                          rules: Any) -> TrainState:
    """TrainState of shardings (a pytree *prefix*: one NamedSharding per nnx.Variable / optimizer leaf)."""
    rules = get_rules(rules)
    params_sh = state_shardings(abstract.params, mesh, rules)
    rep = replicated(mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    # a state leaf shaped like its parameter follows the parameter's sharding; factored statistics (Adafactor's row /
    # column moments) have other shapes and are replicated
    opt_sh = optax.tree_map_params(
        tx, lambda leaf, p, s: s if getattr(leaf, "shape", None) == tuple(p.shape) else rep,
        abstract.opt_state, abstract.params, params_sh, transform_non_params=lambda _: rep, is_leaf=is_var)
    return TrainState(params=params_sh, opt_state=opt_sh, step=rep, rng=rep)


def broadcast_prefix(prefix: Any, full: Any) -> Any:
    """Expand a prefix tree (e.g. one sharding per nnx.Variable) to the full structure of `full`."""
    return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, full)


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStruct tree carrying the given (current) shardings: the restore target (docs/architecture.md §4)."""
    full = broadcast_prefix(shardings, abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, full)


def init_train_state(model_factory: ModelFactory, tx: optax.GradientTransformation, seed: int,
                     shardings: TrainState | None = None) -> tuple[nnx.GraphDef, TrainState]:
    """Initialize params and optimizer state inside one jit whose outputs land on `shardings` (or uncommitted)."""
    box = {}

    def f():
        graphdef, state = _initial_state(model_factory, tx, seed)
        box["graphdef"] = graphdef
        return state

    state = jax.jit(f, out_shardings=shardings)()
    return box["graphdef"], state
