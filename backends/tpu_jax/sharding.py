"""Where every array lives: one rules object from logical axes to a device mesh.

Arrays are described by *logical* axes (``heads``, ``kv_heads``, ``mlp``, ``slots``,
``vocab``, ...); :class:`ShardingRules` maps each to a mesh axis or to nothing
(replicated), and :class:`ShardingPlan` turns a logical description into a
``NamedSharding`` on its ``jax.sharding.Mesh`` of shape ``(dp, tp)``:

- ``tp`` (tensor parallel): attention heads, KV heads and the MLP's hidden units, so
  each device holds ``1/tp`` of every projection and of the KV cache's heads; GSPMD
  inserts the reductions after ``o_proj`` and ``down_proj``.
- ``dp`` (data parallel, optional): the decode slots, so each device group runs
  ``slots/dp`` rows of every generate step with replicated weights.

The rules are data: ``DEFAULT_RULES`` plus the engine option ``sharding_rules``
(e.g. ``{"vocab": "tp"}`` shards the embeddings and LM head over the vocabulary too).
:func:`plan_mesh` sizes the mesh and refuses, before anything is compiled, a mesh the
model cannot be split over (heads not divisible by ``tp``, slots by ``dp``), naming
both numbers. The plan is hashable, so the jitted steps take it as a static argument
and one executable serves every engine with the same shapes and mesh.

Multi-host: with ``jax.distributed`` initialised, ``jax.devices()`` lists every
process's devices and the same plan spans them; :meth:`ShardingPlan.put` builds global
arrays from host data every process holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from polyengine.errors import InvalidRequest
from polyengine.models import ModelConfig

from polyengine.backends.tpu_jax.options import DEFAULT_RULES, LOGICAL_AXES, MESH_AXES, rules_problem

__all__ = ["MESH_AXES", "LOGICAL_AXES", "DEFAULT_RULES", "ShardingRules", "ShardingPlan", "plan_mesh", "param_axes"]


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None: replicated), as a hashable tuple of pairs."""

    pairs: tuple[tuple[str, str | None], ...]

    @classmethod
    def with_overrides(cls, overrides: Mapping[str, Any] | None = None) -> "ShardingRules":
        """``DEFAULT_RULES`` updated by ``overrides`` (the ``sharding_rules`` option);
        unknown logical or mesh axes are refused with InvalidRequest."""
        overrides = dict(overrides or {})
        problem = rules_problem(overrides)
        if problem:
            raise InvalidRequest(f"option sharding_rules {problem}")
        return cls(tuple(sorted({**DEFAULT_RULES, **overrides}.items())))

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else dict(self.pairs)[logical]


def param_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a weight tensor by its HF name (and ``.qweight``/``.scale``
    of int8 weights, which follow their matrix)."""
    leaf = name.rsplit(".", 1)[-1]
    base = name.rsplit(".", 1)[0]
    if base.startswith("rope"):
        return ("positions", "head_dim")
    if base in ("model.embed_tokens", "lm_head"):
        out, inp = "vocab", "embed"
    elif base.endswith(("q_proj", "qkv_proj")):
        out, inp = "heads", "embed"
    elif base.endswith(("k_proj", "v_proj")):
        out, inp = "kv_heads", "embed"
    elif base.endswith("o_proj"):
        out, inp = "embed", "heads"
    elif base.endswith(("gate_proj", "up_proj", "gate_up_proj")):
        out, inp = "mlp", "embed"
    elif base.endswith("down_proj"):
        out, inp = "embed", "mlp"
    else:  # norms
        return ("embed",)[:ndim]
    if leaf == "bias" or ndim == 1:  # a bias, or the per-channel scale of an int8 matrix
        return (out,)
    return (out, inp)


@dataclass(frozen=True)
class ShardingPlan:
    """A mesh ``(dp, tp)`` and the rules; hashable (a static argument of the steps)."""

    mesh: Mesh
    rules: ShardingRules

    @property
    def tp(self) -> int:
        return int(self.mesh.shape["tp"])

    @property
    def dp(self) -> int:
        return int(self.mesh.shape["dp"])

    @property
    def multi_process(self) -> bool:
        return len(self.mesh.local_devices) < self.mesh.devices.size

    def spec(self, axes: Sequence[str | None], shape: Sequence[int] | None = None) -> PartitionSpec:
        """The PartitionSpec of logical ``axes``; with ``shape``, a dimension that the
        mesh axis does not divide stays whole (e.g. a block-scale column count)."""
        out = []
        for i, logical in enumerate(axes):
            axis = self.rules.mesh_axis(logical)
            if axis is not None and shape is not None and shape[i] % int(self.mesh.shape[axis]):
                axis = None
            out.append(axis)
        return PartitionSpec(*out)

    def sharding(self, axes: Sequence[str | None] = (), shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shards(self, axes: Sequence[str | None], shape: Sequence[int]) -> int:
        """Into how many pieces an array of ``shape`` is split (bytes per device = total / this)."""
        spec = self.spec(axes, shape)
        return math.prod(int(self.mesh.shape[a]) for a in spec if a is not None)

    def put(self, value: np.ndarray, axes: Sequence[str | None] = ()) -> jax.Array:
        """Host data (the same in every process) as a global array laid out by ``axes``."""
        value = np.asarray(value)
        sharding = self.sharding(axes, value.shape) if axes else self.replicated
        if not self.multi_process:
            return jax.device_put(value, sharding)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def put_tree(self, tree: Any) -> Any:
        """A pytree of host arrays, replicated, in one batched transfer."""
        if not self.multi_process:
            return jax.device_put(tree, self.replicated)
        return jax.tree_util.tree_map(self.put, tree)

    def constrain(self, x: jax.Array, axes: Sequence[str | None] = ()) -> jax.Array:
        """Inside a jitted step: lay ``x`` out by ``axes`` (replicated when empty)."""
        return jax.lax.with_sharding_constraint(x, self.sharding(axes, x.shape) if axes else self.replicated)

    def describe(self) -> str:
        return f"mesh dp={self.dp} x tp={self.tp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]


def plan_mesh(
    config: ModelConfig,
    slots: int,
    devices: Sequence[Any],
    *,
    tensor_parallel: int = 0,
    data_parallel: int = 0,
    rules: ShardingRules | None = None,
) -> ShardingPlan:
    """Size the mesh and check the model divides over it, before anything compiles.

    0 means "choose": ``tp`` becomes the largest divisor of the devices left that
    divides the heads, the KV heads and the MLP width; ``dp`` the largest that divides
    the devices left and the slots. Explicit sizes are checked, and a mismatch is
    InvalidRequest naming both numbers.
    """
    n = len(devices)
    tp, dp = int(tensor_parallel), int(data_parallel)
    if tp < 0 or dp < 0:
        raise InvalidRequest(f"tensor_parallel ({tp}) and data_parallel ({dp}) must be >= 0 (0 chooses)")
    splits = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "KV heads (num_key_value_heads)": config.num_key_value_heads,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    if tp == 0:
        room = n // dp if dp else n
        tp = next(d for d in _divisors(max(room, 1)) if all(size % d == 0 for size in splits.values()))
    if dp == 0:
        dp = next(d for d in _divisors(max(n // tp, 1)) if slots % d == 0)
    if tp * dp > n:
        raise InvalidRequest(
            f"a mesh of data_parallel={dp} x tensor_parallel={tp} needs {tp * dp} devices but only {n} "
            f"are visible ({devices[0].platform if n else 'none'})")
    for what, size in splits.items():
        if size % tp:
            raise InvalidRequest(
                f"tensor_parallel={tp} does not divide the model's {size} {what}: each device must hold "
                f"whole heads; use a tensor_parallel that divides {size}")
    if slots % dp:
        raise InvalidRequest(
            f"data_parallel={dp} does not divide the {slots} slots (max_slots): each device group holds "
            f"slots/dp rows; use a data_parallel that divides {slots}")
    chosen = list(devices[: dp * tp])
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh((dp, tp), chosen)
    except (AssertionError, ValueError, NotImplementedError):  # no topology information (CPU): plain order
        grid = np.array(chosen, dtype=object).reshape(dp, tp)
    mesh = Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return ShardingPlan(mesh, rules or ShardingRules.with_overrides())
