"""Constrained argument types that LightningCLI checks while it parses, so a bad YAML value is named with its key.

jsonargparse (LightningCLI's parser) reads these from the constructors' signatures at runtime and rejects a value
outside the range before any class is built, with the key and the value in its message. Type checkers see plain
``int``, ``float`` and ``dict[int, int]``, so a user's ``AccumulationScheduler(micro_batch_size=4)`` type-checks. The
constructors keep their own checks and messages for the Python API.

jsonargparse 4.53 never validates the keys of a ``dict[K, V]`` (it only casts them when ``K`` is exactly ``int``), so
``dict[NonNegativeInt, PositiveInt]`` lets a negative position through to the constructor and leaves the string keys
of a JSON config uncast: :data:`Scheduling` checks the whole mapping instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PositiveInt = int
    NonNegativeInt = int
    PositiveFloat = float
    Decay = float
    Confidence = float
    Scheduling = dict[int, int]
else:
    from jsonargparse.typing import NonNegativeInt, PositiveFloat, PositiveInt, register_type, restricted_number_type

    Decay = restricted_number_type("Decay", float, [(">=", 0), ("<", 1)], join="and", docstring="a number in [0, 1)")
    Confidence = restricted_number_type(
        "Confidence", float, [(">=", 0.5), ("<", 1)], join="and", docstring="a number in [0.5, 1)"
    )

    class Scheduling(dict):
        """``{position: factor}``: positions are integers >= 0, factors integers >= 1, at least one pair."""

    register_type(
        Scheduling,
        serializer=lambda value: {int(k): int(v) for k, v in value.items()},
        deserializer=lambda value: parse_scheduling(value),
        type_check=lambda value, cls: False,
    )


def parse_scheduling(value: Any) -> dict[int, int]:
    """Check a ``{position: factor}`` mapping as the parser reads it; keys may be strings of digits (JSON).

    Raises:
        TypeError: If ``value`` is not a mapping.
        ValueError: If a position is not an integer >= 0 or a factor not an integer >= 1; the message names the
            pair. (An empty mapping parses; the constructor refuses it.)

    Example::

        >>> parse_scheduling({"0": 2, 50: 4})
        {0: 2, 50: 4}
    """
    from jsonargparse.typing import NonNegativeInt, PositiveInt

    if not isinstance(value, dict):
        raise TypeError(f"expected a mapping {{position: factor}}, got {value!r}")
    # an empty mapping parses: refused here, `--trainer.callbacks.scheduling={}` would make jsonargparse fall back to
    # a bare Callback (it skips an unknown key whose value is an empty mapping) and drop the scheduler. Its constructor
    # refuses it, naming `scheduling`: with a traceback under plain LightningCLI, which lets a constructor's error
    # through, and as a parse error under AccumulationArgumentParser
    checked = {}
    for key, factor in value.items():
        try:
            position = int(NonNegativeInt(key))
        except (TypeError, ValueError):
            raise ValueError(f"position {key!r} is not an integer >= 0") from None
        try:
            checked[position] = int(PositiveInt(factor))
        except (TypeError, ValueError):
            raise ValueError(f"factor {factor!r} at position {key!r} is not an integer >= 1") from None
    return checked


__all__ = ["Confidence", "Decay", "NonNegativeInt", "PositiveFloat", "PositiveInt", "Scheduling", "parse_scheduling"]
