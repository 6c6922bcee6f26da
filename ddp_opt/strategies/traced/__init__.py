"""The traced strategy (``compile_ddp(..., strategy="traced")``), everything particular to it:
``plan`` (the backend, the bucket plan and the fusion pass, Note [Traced strategy]),
``placement`` (where each bucket's wait and update run in the backward graph), ``update``
(the optimizer in backward traced into that graph, Note [Traced update]), ``powersgd``
(PowerSGD's power iteration traced there, Note [Traced PowerSGD]) and ``_torch_internals``
(the private torch accesses of its graph passes)."""
