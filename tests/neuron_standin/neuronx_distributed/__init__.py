"""A recording stand-in for AWS's neuronx-distributed, for tests on a machine without
Neuron devices: the parts polyengine's Neuron path uses (``trace.model_builder``,
``parallel_layers.mappings``, ``parallel_layers.parallel_state``), with the rules of the
real stack enforced and every transfer recorded (``_device.RECORD``). Nothing here is
AWS's code; it follows the documented API."""

__version__ = "0.0.0+standin"
