"""Makes a Python process see tests/neuron_standin as torch-neuronx and neuronx-distributed
(test_neuron_device.py's fixture, for a process of its own: a conformance run on the
Neuron path). On PYTHONPATH only for that process: importing torch here costs its start."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "neuron_standin"))

import torch  # noqa: E402
import neuronx_distributed.trace.model_builder as mb  # noqa: E402

_save, _load = torch.jit.save, torch.jit.load


def _jit_save(obj, f, *args, **kwargs):
    return mb.save(obj, f) if isinstance(obj, mb.Executor) else _save(obj, f, *args, **kwargs)


def _jit_load(f, *args, **kwargs):
    return mb.load(f) or _load(f, *args, **kwargs)


torch.jit.save, torch.jit.load = _jit_save, _jit_load
