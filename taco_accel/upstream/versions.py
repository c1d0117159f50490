"""The supported-range check each adapter module runs at the entry points that need its library."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

from ..errors import ConfigError


def check_range(package: str, low: str, high: str) -> str | None:
    """The installed version of ``package`` (as its distribution metadata says); a ConfigError
    outside [low, high); None if absent."""
    try:
        found = version(package)
    except PackageNotFoundError:
        return None
    if not Version(low) <= Version(Version(found).base_version) < Version(high):
        raise ConfigError(f"{package} {found} is installed; taco_accel uses private parts of {package} checked "
                          f"against >={low},<{high}: install a version in that range (pip install "
                          f"'{package}>={low},<{high}'), or a taco_accel release made for {package} {found}")
    return found
