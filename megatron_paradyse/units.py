"""Byte units, defined once for the package: no package imports, so every layer may use them."""

MiB = float(1 << 20)
GiB = float(1 << 30)
