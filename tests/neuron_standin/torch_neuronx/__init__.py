"""A stand-in for AWS's torch-neuronx, for tests without Neuron devices. polyengine's
Neuron path builds its graphs with neuronx-distributed's ModelBuilder (the stand-in
beside this one, which does the recording); from torch-neuronx it needs only the
import (which registers the Neuron ops a saved program loads with) and the version."""

__version__ = "2.0.0+standin"


def trace(*args, **kwargs):
    raise NotImplementedError("the stand-in covers what polyengine's Neuron path uses: neuronx-distributed's "
                              "ModelBuilder (one traced program per engine), not torch_neuronx.trace")
