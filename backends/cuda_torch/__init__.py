"""The cuda_torch backend: PyTorch inference on NVIDIA GPUs (CUDA), and on the CPU
where no GPU is present. Built on the shared torch model and sampler
(``polyengine.backends.torch_common``) and the core's backend kit."""
