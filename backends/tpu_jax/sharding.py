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

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from polyengine.errors import InvalidRequest
from polyengine.models import ModelConfig

from polyengine.backends.tpu_jax.footprint import mesh_axes, mesh_shape, param_axes, shards
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
        return PartitionSpec(*mesh_axes(axes, shape, self.mesh.shape, dict(self.rules.pairs)))

    def sharding(self, axes: Sequence[str | None] = (), shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def shards(self, axes: Sequence[str | None], shape: Sequence[int]) -> int:
        """Into how many pieces an array of ``shape`` is split (bytes per device = total / this)."""
        return shards(axes, shape, self.mesh.shape, dict(self.rules.pairs))

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


def plan_mesh(
    config: ModelConfig,
    slots: int,
    devices: Sequence[Any],
    *,
    tensor_parallel: int = 0,
    data_parallel: int = 0,
    rules: ShardingRules | None = None,
) -> ShardingPlan:
    """Size the mesh (:func:`.footprint.mesh_shape`: 0 chooses, explicit sizes are
    checked) and lay ``devices`` out on it, before anything compiles."""
    platform = devices[0].platform if devices else "none"
    dp, tp = mesh_shape(config, slots, len(devices), tensor_parallel=tensor_parallel, data_parallel=data_parallel,
                        platform=platform)
    chosen = list(devices[: dp * tp])
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh((dp, tp), chosen)
    except (AssertionError, ValueError, NotImplementedError):  # no topology information (CPU): plain order
        grid = np.array(chosen, dtype=object).reshape(dp, tp)
    mesh = Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return ShardingPlan(mesh, rules or ShardingRules.with_overrides())
