"""What a memory budget means: a fraction between the feasible extremes, or a size in bytes.

    0.0 .. 1.0        fraction: 0 = the fewest saved bytes any valid plan has (everything
                      recomputable recomputed), 1 = the plan without a budget, linear in saved
                      bytes between them (PyTorch's ``activation_memory_budget`` convention)
    "512MiB", "1.5GB", "4096B", "50%"   a size with a unit (or a percentage)
    an int > 1        a number of bytes (0 and 1 read as fractions, as in PyTorch)
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Optional

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")  # a sign: named below


@dataclass(frozen=True)
class Budget:
    fraction: Optional[float] = None  # in [0, 1]
    nbytes: Optional[int] = None

    def target(self, minimum: int, maximum: int) -> int:
        """The byte target: a fraction interpolates linearly between the feasible extremes."""
        if self.nbytes is not None:
            return self.nbytes
        return minimum + math.floor(self.fraction * max(maximum - minimum, 0))

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.nbytes is None else fmt_bytes(self.nbytes)


def parse_budget(value, what: str = "memory_budget",
                 fraction: str = "0 = save the minimum, 1 = no budget") -> Optional[Budget]:
    """A Budget from what users write; None stays None. Errors say what is accepted, ``fraction``
    what a fraction means for ``what``."""
    if value is None or isinstance(value, Budget):
        return value
    hint = (f"{what} takes a fraction in [0, 1] ({fraction}), a size with a "
            f"unit such as '512MiB', '1.5GB', '4096B' or '50%', or an int number of bytes > 1")
    if isinstance(value, bool):
        raise ValueError(f"{hint}; got {value!r}")
    if isinstance(value, numbers.Integral):  # numpy's ints too, read as ints
        value = int(value)
    elif isinstance(value, numbers.Real):  # numpy's floats (np.float64 is a float, shown as itself), a Fraction
        value = float(value)
    if isinstance(value, int):
        if value in (0, 1):
            return Budget(fraction=float(value))
        if value < 0:
            raise ValueError(f"{hint}; got a negative size {value}")
        return Budget(nbytes=value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{hint}; got {value!r}")
        if value < 0:
            raise ValueError(f"{hint}; got a negative fraction {value!r}")
        if value > 1:
            raise ValueError(f"{hint}; got {value!r} (a float must be a fraction; for a size write an int "
                             f"number of bytes or a string with a unit, e.g. '{value:g}GiB')")
        return Budget(fraction=value)
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            number, unit = float(m.group(1)), m.group(2).lower()
            if number < 0 and (unit == "%" or unit in _UNITS):
                raise ValueError(f"{hint}; got a negative {'percentage' if unit == '%' else 'size'} {value!r}")
            if unit == "%":
                if number > 100:
                    raise ValueError(f"{hint}; got {value!r} (a percentage is at most 100%)")
                return Budget(fraction=number / 100)
            if unit in _UNITS:
                if not math.isfinite(number * _UNITS[unit]):
                    raise ValueError(f"{hint}; got {value!r} (too large to be a number of bytes)")
                return Budget(nbytes=int(round(number * _UNITS[unit])))
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None and 0 <= number <= 1:
            # a number without a unit, in a string (read from a config file or the command line)
            raise ValueError(f"{hint}; got the string {value!r}: for the fraction {number:g}, pass the float "
                             f"{float(number)!r}, not a string")
        if number is not None and 1 < number < 2**63 and number == int(number):
            raise ValueError(f"{hint}; got the string {value!r}, a number without a unit: pass the int "
                             f"{int(number)} for bytes, or give the unit, e.g. '{int(number)}B'")
        raise ValueError(f"{hint}; got {value!r} (units: {', '.join(sorted(_UNITS, key=_UNITS.get))})")
    raise ValueError(f"{hint}; got {type(value).__name__} {value!r}")


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
