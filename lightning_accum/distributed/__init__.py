"""The distributed mechanics: what a window does to torch's data-parallel wrappers, and collectives of its own.

Skipping and deferring gradient reductions (DDP, FSDP1, FSDP2, HSDP: :mod:`~lightning_accum.distributed.sync`),
FSDP2 in float32 under bf16 (:mod:`~lightning_accum.distributed.fsdp2_precision`), ZeRO's window gradients
(:mod:`~lightning_accum.distributed.zero`), the noise scale's per-micro-batch gradient norms
(:mod:`~lightning_accum.distributed.noise_grads`) and the exact large batch of a contrastive loss
(:mod:`~lightning_accum.distributed.coupled`: ``cached``, ``all_gather_with_grad``).

May import: torch, :mod:`lightning_accum.compat` and :mod:`lightning_accum.core`; never Lightning.
"""
