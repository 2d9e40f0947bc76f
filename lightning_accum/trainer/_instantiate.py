"""A one-line exit for a callback that LightningCLI cannot construct, under plain ``LightningCLI`` too.

Plain ``LightningCLI`` (no ``parser_class``) builds the callbacks itself and catches nothing their constructors raise:
jsonargparse wraps the ``ValueError`` of a combination no single argument's type can refuse (``adaptive: true``
without ``noise_scale``, ``scheduling: {}``) in a union error and Python prints it with a traceback. Importing
lightning_accum registers a jsonargparse instantiator for :class:`~lightning_accum.AccumulationScheduler` only: it
constructs the callback as the default instantiator does and, when the constructor refuses a value, ends the process
as a parse error does (the message on stderr, exit status 2). Outside jsonargparse's instantiation nothing changes: a
``ValueError`` from ``AccumulationScheduler(...)`` in Python code is raised as always.
"""

from __future__ import annotations

import sys
from typing import Any


def register(callback_class: type) -> None:
    """Register the instantiator for ``callback_class`` (and its subclasses) with jsonargparse, once per process."""
    try:
        from jsonargparse import add_instantiator
    except ImportError:  # an older jsonargparse: plain LightningCLI prints the traceback, as before
        return
    add_instantiator(_instantiate, callback_class, subclasses=True)


def _instantiate(class_type: type, *args: Any, **kwargs: Any) -> Any:
    try:
        return class_type(*args, **kwargs)
    except (TypeError, ValueError) as error:
        print(f"error: {class_type.__name__}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
