"""The distributed engine: one ``("pp", "dp", "cp", "tp")`` device mesh, DTensor TP/SP, context parallelism,
pipelining, FSDP2/DDP and DCP.

The model knows nothing of this package: plans are applied from outside in the order pipeline split → tensor
parallel → activation checkpointing → compile → FSDP2/DDP (see ``docs/DISTRIBUTED.md``).
"""
