"""The Lightning and torch releases lightning_accum supports, checked where each is first met.

``import lightning_accum`` checks ``lightning`` (a dependency) and ``torch``; the standalone ``pytorch_lightning`` or
``lightning_fabric``, which may be of another release than ``lightning`` in the same environment, is checked when
it is first met (``import lightning_accum.pytorch_lightning``, or a standalone Trainer or Fabric handed to the
callback or the Accumulator). A release outside the range raises ``ImportError`` naming the installed and the
supported versions, instead of failing deep inside a fit. ``pyproject.toml`` declares the same range
(``tests/test_versions.py`` holds the two together). No Lightning import.
"""

from __future__ import annotations

import re
from importlib import metadata

# the oldest supported release of each, and the first unsupported Lightning release (the loop routing in _loop.py is
# tested against every minor release from LIGHTNING_FLOOR up to, not including, LIGHTNING_CEILING)
LIGHTNING_FLOOR = (2, 5, 1)
LIGHTNING_CEILING = (2, 7, 0)
TORCH_FLOOR = (2, 4, 0)


def release(version: str) -> tuple[int, int, int]:
    """The numeric release of a version string (``"2.13.0+cpu"`` gives ``(2, 13, 0)``).

    Example::

        >>> release("2.6.0rc1")
        (2, 6, 0)
    """
    numbers = [int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3]]
    return (*numbers, 0, 0, 0)[:3]  # type: ignore[return-value]


def _text(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def lightning_range() -> str:
    """The supported Lightning releases, as a requirement reads them: ``">=2.5.1,<2.7.0"``."""
    return f">={_text(LIGHTNING_FLOOR)},<{_text(LIGHTNING_CEILING)}"


def check_lightning(package: str, version: str) -> None:
    """Raise ``ImportError`` if ``version`` of the Lightning package ``package`` is outside the supported range.

    Args:
        package: ``"lightning"``, ``"pytorch_lightning"`` or ``"lightning_fabric"`` (named in the message).
        version: Its ``__version__``.

    Raises:
        ImportError: If the release is older than the floor or not older than the ceiling.
    """
    if not LIGHTNING_FLOOR <= release(version) < LIGHTNING_CEILING:
        raise ImportError(
            f"lightning_accum supports {package} {lightning_range()}, but {package} {version} is installed: install"
            f" a supported release (pip install '{package.replace('_', '-')}{lightning_range()}')"
        )


def check_torch(version: str) -> None:
    """Raise ``ImportError`` if torch ``version`` is older than the supported floor.

    Raises:
        ImportError: If the release is older than :data:`TORCH_FLOOR`.
    """
    if release(version) < TORCH_FLOOR:
        raise ImportError(
            f"lightning_accum supports torch>={_text(TORCH_FLOOR)}, but torch {version} is installed: install a"
            f" supported release (pip install 'torch>={_text(TORCH_FLOOR)}')"
        )


def check_installed() -> None:
    """Check the installed ``lightning`` and ``torch`` (by their metadata: before either is imported).

    Raises:
        ImportError: If either is outside the supported range.
    """
    for distribution, check in (
        ("lightning", lambda version: check_lightning("lightning", version)),
        ("torch", check_torch),
    ):
        try:
            version = metadata.version(distribution)
        except metadata.PackageNotFoundError:  # not installed as a distribution: its own import says what is wrong
            continue
        check(version)
