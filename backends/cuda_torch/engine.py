"""The cuda_torch engine: the shared torch engine on a GPU (CUDA, or ROCm through
torch's HIP build, which answers to the same ``cuda`` device type).

Every decode step runs all slots in one forward from device data (rows of empty slots
write nothing), samples on the device, and starts the copy of its one packed result
buffer at once (pinned memory, non-blocking), so the host queues step n+1 while step n
runs. Option ``cuda_graphs`` replays the decode forward from a CUDA graph per kv_len
bucket.

Without a GPU this backend refuses and names the ``cpu`` backend. Option
``device='cpu'`` runs this device path on the CPU all the same: a stand-in that the
tests and the conformance suite use to check the device path where no GPU is (every
slot from device data, no host kernels), not a way to run models fast on a CPU.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from polyengine.engine import Capabilities, EngineConfig, ResultLayout, ResultTokens
from polyengine.errors import BackendUnavailable, InvalidRequest, UnsupportedFeature
from polyengine.hostinfo import has_bf16_units
from polyengine.models import Model
from polyengine.models.config import ARCHITECTURES
from polyengine.models.int_blocks import block_matrices
from polyengine.sampling.params import ENGINE_FIELDS, MAX_TOP_LOGPROBS

from polyengine.backends.cuda_torch.options import OPTIONS, WEIGHT_FORMATS
from polyengine.backends.torch_common.blocks import block_linear, int4_runs, pack_matrix, packed_bytes
from polyengine.backends.torch_common.engine import TorchDecodeState, TorchEngine
from polyengine.backends.torch_common.model import TorchWeights, forward

__all__ = ["CudaEngine", "create_engine", "describe"]

NO_GPU = ("no GPU here (no NVIDIA /dev/nvidiaN, no AMD /dev/kfd, and torch sees none): use backend 'cpu' "
          "(--backend cpu), the CPU engine; option device='cpu' runs cuda_torch's device path on the CPU as a "
          "test stand-in only")


class CudaEngine(TorchEngine):
    name = "cuda_torch"
    OPTIONS = OPTIONS

    def capabilities_for(self, model: Model, config: EngineConfig) -> Capabilities:
        device = self.torch_device = _pick_device(self.options["device"])
        if self.options["cuda_graphs"] and device.type != "cuda":
            raise UnsupportedFeature("cuda_graphs on the CPU", self.name, "CUDA graphs need a CUDA device")
        self.device = _device_name(device)
        if device.type == "cuda":
            dtypes = ("bfloat16", "float16", "float32")
        else:  # the stand-in: what torch computes well on this CPU
            dtypes = ("float32", "bfloat16") if has_bf16_units() else ("float32",)
        return Capabilities(
            dtypes=dtypes, sampling_params=ENGINE_FIELDS, max_top_logprobs=MAX_TOP_LOGPROBS,
            bulk_insert=True, portable_prefix=True, prefix_reuse=True, prefix_truncate=True, async_results=True,
            portable_prefix_tail=True,  # paged: the head's pages shared; contiguous: the kit's copy
            architectures=ARCHITECTURES, token_masks=True, embeddings=True, weight_formats=WEIGHT_FORMATS,
            batched_prefill=self.batches_prefill(),
            page_size=self.options["page_size"],
        )

    def _resolve(self) -> None:
        # Matrices stored in a GGUF block format stay in their blocks on the device
        # (torch_common/blocks.py); every other weight is converted to float at load.
        self._blocks = block_matrices(self.model, self.capabilities.weight_formats)
        if self._blocks:
            self._linear = self._prefill_linear = block_linear

    def _weight_needs(self) -> dict[str, int]:
        if not self._blocks:
            return super()._weight_needs()
        shapes = self.model.config.weight_shapes()
        sources = set(self._blocks.values())
        rest = [n for n in shapes if n not in sources]
        if self.torch_device.type == "cpu" and self.torch_dtype == torch.float32:  # F32 records are used as stored
            floats = self.model.conversion_bytes(rest)
        else:
            floats = sum(math.prod(shapes[n]) for n in rest) * self.torch_dtype.itemsize
        blocks = sum(packed_bytes(self.model.records[s].format, shapes[s], self.torch_device, self.torch_dtype)
                     for s in sources)
        return {f"{self.dtype} weights on {self.torch_device} (those not kept in blocks)": floats,
                f"{len(sources)} matrices kept in their GGUF blocks": blocks}

    def _load_weights(self) -> TorchWeights:
        """The float weights in the compute dtype, then each block matrix repacked,
        one tensor at a time (never a float copy of it)."""
        if not self._blocks:
            return super()._load_weights()

        def load() -> TorchWeights:
            weights = TorchWeights.from_model(self.model, device=self.torch_device, dtype=self.torch_dtype,
                                              max_positions=self.max_cache_length,
                                              skip=frozenset(self._blocks.values()))
            for name, source in self._blocks.items():
                record = self.model.weight(source, self.capabilities.weight_formats)  # as stored: no float copy
                weights.tensors.update(pack_matrix(record, name, device=self.torch_device, dtype=self.torch_dtype))
            return weights

        return self._allocating("the weights", load)

    def _memory_available(self) -> dict:
        if self.torch_device.type != "cuda":
            return {}
        return {"where": f"{self.torch_device} memory", "available": torch.cuda.mem_get_info(self.torch_device)[0]}

    def speed_paths(self) -> dict[str, str]:
        """What this engine runs on: its startup log line, ``polyengine generate``'s stderr."""
        paths = describe(self.torch_device, self.torch_dtype, self.options["cuda_graphs"])
        if self._blocks:
            shapes = self.model.config.weight_shapes()
            int4 = sum(int4_runs(self.model.records[s].format, shapes[s], self.torch_device, self.torch_dtype)
                       for s in self._blocks.values())
            paths["weights"] = (f"{int4} matrices on torch's int4 op (Q4_0/Q4_1/Q4_K), {len(self._blocks) - int4} as "
                                f"int8 values with group scales (Q8_0, the 5- and 6-bit formats, or a 4-bit one "
                                f"where that op does not run); the rest "
                                f"converted to {self.dtype} at load, one tensor at a time")
        return paths

    def _results(self, buf: torch.Tensor, layout: ResultLayout) -> ResultTokens:
        if self.torch_device.type != "cuda":
            return super()._results(buf, layout)
        return ResultTokens.from_packed(buf, layout, start_copy=_copy_to_host_async, to_host=_finish_copy)

    def _device_forward(self, params: TorchWeights, state: TorchDecodeState, pos: torch.Tensor,
                        live_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
        if not self.options["cuda_graphs"]:
            return super()._device_forward(params, state, pos, live_mask, kv_len)
        return self._graph_forward(params, state, pos, live_mask[:, None], kv_len)

    def _graph_forward(self, params: TorchWeights, state: TorchDecodeState, pos: torch.Tensor, live: torch.Tensor,
                       kv_len: int) -> torch.Tensor:
        """The decode forward replayed from a CUDA graph captured per kv_len bucket over
        this state's static buffers (tokens, positions, live mask, caches): one launch
        instead of ~50 kernels a layer. The first use of a bucket runs the step eagerly
        twice (idempotent: same inputs, same cache writes) before capturing it."""
        if state.positions is None:
            state.positions, state.live = torch.zeros_like(pos), torch.zeros_like(live)
        state.positions.copy_(pos)
        state.live.copy_(live)

        def run() -> torch.Tensor:
            return forward(params, self._spec(kv_len=kv_len, linear=self._linear, kv_codec=self._kv_codec),
                           state.next_tokens[:, None],
                           state.positions, state.k, state.v, rows=None, write_mask=state.live,
                           page_table=state.page_table)[0]

        # Paged: a grown page pool is a new buffer, so a graph is kept per pool too.
        key = kv_len if state.page_table is None else (kv_len, state.k.data_ptr())
        entry = state.graphs.get(key)
        if entry is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = run()
            # Milliseconds, once per bucket, mid-reply: a debug line (-vv), not a progress line.
            logging.getLogger(__name__).debug("captured the decode CUDA graph for kv_len %d", kv_len)
            entry = state.graphs[key] = (graph, logits)
        graph, logits = entry
        graph.replay()
        return logits


def _pick_device(name: str) -> torch.device:
    """Option ``device``: a GPU, or the CPU stand-in only when asked for by name."""
    if not name:
        if not torch.cuda.is_available():
            raise BackendUnavailable("cuda_torch", NO_GPU)
        return torch.device("cuda:0")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequest(f"option device={name!r} is not a torch device ({exc})", field="options.device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(f"option device={name!r}: {NO_GPU}", field="options.device")
    if device.type not in ("cuda", "cpu"):
        raise InvalidRequest(f"option device={name!r}: cuda_torch runs on 'cuda[:N]' (or 'cpu' as a test stand-in)",
                             field="options.device")
    return device


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index or 0
        runtime = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        return f"cuda:{index} ({torch.cuda.get_device_name(index)}, {runtime})"
    return f"cpu stand-in of the device path ({torch.get_num_threads()} threads)"


def describe(device: torch.device, dtype: torch.dtype, cuda_graphs: bool) -> dict[str, str]:
    """The device path in words: the engine's speed paths, and ``polyengine backends
    --verbose`` (with the defaults)."""
    graphs = "replayed from a CUDA graph per kv_len bucket (option cuda_graphs)" if cuda_graphs else (
        "eager (cuda_graphs=False)")
    name = str(dtype).replace("torch.", "")
    if device.type != "cuda":
        return {"device": _device_name(device),
                "decode": f"the shared torch forward over every slot from device data, {name} (a stand-in of the "
                          f"GPU path; backend 'cpu' is the CPU engine)"}
    return {"device": _device_name(device), "decode": f"the shared torch forward on the GPU, {name}, {graphs}",
            "weights": f"{name} copies on the device; int8/bfloat16 host formats are the cpu backend's"}


def diagnose() -> dict[str, str]:
    """What an engine with the default options would run here (``polyengine backends --verbose``)."""
    from polyengine.backends.torch_common.paged import TAIL_IMPORT

    if not torch.cuda.is_available():
        return {"device": f"none: {NO_GPU}", "prefix tails": TAIL_IMPORT}
    return {**describe(torch.device("cuda:0"), torch.bfloat16, False), "prefix tails": TAIL_IMPORT}


def _copy_to_host_async(buf: torch.Tensor):
    """Start the device-to-host copy of a step's packed results (pinned, non-blocking)."""
    host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    host.copy_(buf, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _finish_copy(handle) -> np.ndarray:
    host, done = handle
    done.synchronize()
    return host.numpy()


def create_engine(*, model: Model, config: EngineConfig) -> CudaEngine:
    return CudaEngine(model, config)
