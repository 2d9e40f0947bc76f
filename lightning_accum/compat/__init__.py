"""What the installed releases offer: the bottom layer, asked by feature, never by scattered version comparisons.

- :mod:`~lightning_accum.compat.versions`: the supported Lightning and torch releases, checked at import.
- :mod:`~lightning_accum.compat.torch`: what this torch offers (FSDP2's and DTensor's names where this release keeps
  them, pytree key paths) and the FSDP2 mechanics' floor.
- :mod:`~lightning_accum.compat.lightning`: the Lightning names of the namespace the object in hand belongs to
  (``lightning.pytorch``/``lightning.fabric`` or the standalone ``pytorch_lightning``/``lightning_fabric``).

May import: nothing of lightning_accum outside this folder, and no Lightning at load time (a namespace's names are
imported when first asked for).
"""
