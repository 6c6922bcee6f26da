"""What a running job stands on: the process group (``dist``), the model and its
DDP/FSDP/compile wrapping (``parallel``), precision, preemption, the finite-loss guard,
recompile accounting and compile statistics, and every private torch name the launcher
uses (``_torch_internals``)."""
